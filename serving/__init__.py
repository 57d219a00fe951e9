"""Serving: the only layer that knows Ray. It hosts engines (Ray Serve replicas, or in-process), routes
requests to replicas by load and prefix, carries the replicas' stats to the gateway, builds the Serve
applications KubeRay deploys, and starts a gateway in front of the pools (one bootstrap for all)."""
