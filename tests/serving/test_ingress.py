"""What the Serve-deployed gateway's arguments carry: never a secret (Ray keeps arguments in its GCS)."""

from __future__ import annotations

from gateway.settings import GatewaySettings
from serving.ingress import gateway_deployment
from tenancy import TenancySettings


def _tenancy_args(settings: TenancySettings) -> dict:
    app = gateway_deployment(GatewaySettings(), settings, pools={}, model_paths={})
    return app._bound_deployment.init_args[1]


def test_secrets_and_a_redis_password_stay_out_of_the_deployment_arguments() -> None:
    with_password = TenancySettings(store="redis", redis_url="redis://:s3cret@redis:6379/0", secret="k" * 32)
    args = _tenancy_args(with_password)
    assert "secret" not in args and "redis_url" not in args
    assert "s3cret" not in repr(args)
    plain = _tenancy_args(TenancySettings(store="redis", redis_url="redis://redis:6379/0", secret="k" * 32))
    assert plain["redis_url"] == "redis://redis:6379/0"  # nothing secret in it: replicas get it as given
