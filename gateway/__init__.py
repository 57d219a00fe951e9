"""The gRPC gateway: authentication, validation, admission, priority tagging, dispatch, streaming."""
