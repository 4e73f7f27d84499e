"""The scale-out application on Ray Serve: `build_app` (ingress + engine deployments) and `serve_on_ray`
(what `loraplex serve --replicas N` runs).

Shared state, checked before anything starts: with more than one engine replica or ingress, quotas must
live in Redis (`LORAPLEX_REDIS_URL`), or each process would count its own limits; the database is one
URL for every ingress (`LORAPLEX_DATABASE_URL`: PostgreSQL on a cluster; the default SQLite file only
on one machine); `LORAPLEX_HOME`'s adapter store is a path every ingress and replica reads (on a
cluster, a shared filesystem). The driver migrates the database and makes the admin key once, before
the ingresses start, so they never race on it.
"""

from __future__ import annotations

import logging
import signal
import threading

from loraplex.platform.config import Settings
from loraplex.platform.gateway import prepare_storage

logger = logging.getLogger(__name__)

APP_NAME = "loraplex"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Gateway"
ROUTERS = ("affinity", "pow2")
# Serve's own per-replica limits sit above the engine's: the engine sheds by its waiting queue (503
# server_overloaded), and only past these does Serve queue (then BackPressureError, also a 503).
MAX_ONGOING_PER_REPLICA = 1024
MAX_QUEUED_PER_HANDLE = 256
# Serve's health checks of an engine replica (`EngineReplica.check_health`), tighter than Serve's 10 s /
# 30 s: a hung replica is replaced in about a minute (Serve gives up on it after 3 failed checks in a
# row); its calls end sooner, at the ingress's replica_stall_timeout_s.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 10.0


def check_shared_state(settings: Settings, num_replicas: int, num_ingresses: int) -> None:
    """Raise ValueError, saying what to set, when several processes would keep state of their own."""
    if num_replicas < 1 or num_ingresses < 1:
        raise ValueError("--replicas and --ingresses must be at least 1")
    if (num_replicas > 1 or num_ingresses > 1) and not settings.redis_url:
        raise ValueError(
            f"{num_replicas} engine replicas and {num_ingresses} ingress(es) share tenants' quotas through Redis: "
            "set LORAPLEX_REDIS_URL (e.g. redis://localhost:6379/0); without it each process would count "
            "its own rpm, tpm and concurrency (docs/scale-out.md)")


class Ingress:
    """The gateway as a Ray Serve ingress: the FastAPI app of one process, with `RayEngineClient` over
    the engine deployment's handle as its engine (built in the replica, `__serve_build_asgi_app__`)."""

    def __init__(self, settings: dict, engine):
        self.settings = Settings(**settings)
        self.engine = engine

    async def __serve_build_asgi_app__(self):
        from loraplex.platform.main import create_app
        from loraplex.platform.scaleout.client import RayEngineClient

        client = RayEngineClient(self.engine, self.settings.model_id,
                                 accept_timeout_s=self.settings.replica_accept_timeout_s,
                                 stall_timeout_s=self.settings.replica_stall_timeout_s,
                                 count_replicas=num_running_replicas)
        await client.start()
        return create_app(self.settings, client, migrate=False)


def num_running_replicas() -> int:
    """Engine replicas in Serve's RUNNING state (blocking: a call to Serve's controller)."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
    return deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0


def build_app(settings: Settings, num_replicas: int, num_ingresses: int = 1, router: str = "affinity",
              replica_cpus: float = 1.0):
    """The Serve application: `num_ingresses` gateways in front of `num_replicas` engine replicas, each
    replica given `replica_cpus` CPUs (its engine's threads); `router` "affinity"
    (`router.AdapterAffinityRouter`) or "pow2" (Ray Serve's default power-of-two choices)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from loraplex.platform.scaleout.replica import engine_replica

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    check_shared_state(settings, num_replicas, num_ingresses)
    values = settings.model_dump()
    engine_options = dict(name=ENGINE_DEPLOYMENT, num_replicas=num_replicas,
                          max_ongoing_requests=MAX_ONGOING_PER_REPLICA, max_queued_requests=MAX_QUEUED_PER_HANDLE,
                          health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
                          ray_actor_options={"num_cpus": replica_cpus})
    # what a replica reports as held: its host cache (adapter slots are a subset), or without a limit on
    # that, its slots and the host cache's most recent ones
    resident = settings.max_cpu_loras or 8 * settings.max_loras
    if router == "affinity":
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class="loraplex.platform.scaleout.router:AdapterAffinityRouter",
            request_router_kwargs={"slack": settings.affinity_slack, "capacity": resident})
    engine = serve.deployment(engine_replica(resident), **engine_options).bind(values)
    ingress = serve.deployment(serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=num_ingresses,
                               max_ongoing_requests=MAX_ONGOING_PER_REPLICA, ray_actor_options={"num_cpus": 0})
    return ingress.bind(values, engine)


def start(settings: Settings, num_replicas: int, num_ingresses: int = 1, router: str = "affinity",
          ray_address: str | None = None, replica_cpus: float = 1.0) -> None:
    """Connect to Ray (`ray_address`, else `RAY_ADDRESS`, else a local instance on this machine), prepare
    the shared storage, and run the application with Serve's HTTP proxy on settings.host:port."""
    check_shared_state(settings, num_replicas, num_ingresses)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--replicas runs on Ray Serve, which is not installed: pip install -e '.[ray]' in the checkout") from None
    prepare_storage(settings)
    if not ray.is_initialized():
        ray.init(address=ray_address, logging_level=logging.WARNING)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings, num_replicas, num_ingresses, router, replica_cpus), name=APP_NAME,
              route_prefix="/")


def stop() -> None:
    from ray import serve

    serve.delete(APP_NAME)


def serve_on_ray(settings: Settings, num_replicas: int, num_ingresses: int = 1, router: str = "affinity",
                 ray_address: str | None = None, replica_cpus: float = 1.0) -> int:
    """Run until SIGINT or SIGTERM, then delete the application (a local Ray instance stops with us)."""
    start(settings, num_replicas, num_ingresses, router, ray_address, replica_cpus)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"loraplex: serving {settings.model_id} on http://{settings.host}:{settings.port} with {num_replicas} "
          f"engine replica(s) and {num_ingresses} ingress(es) on Ray Serve ({router} routing)", flush=True)
    done.wait()
    logger.info("stopping the Serve application")
    stop()
    return 0
