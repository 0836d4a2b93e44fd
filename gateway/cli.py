"""The `prefix-gateway` command: serve, up, sim, stats, experiments, hash-key, openapi."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, GatewayConfig, RedisConfig, load_config
from gateway.defaults import BATCH_REPLICAS, REALTIME_REPLICAS

log = logging.getLogger("prefix_gateway")

REDIS_ENV = "PREFIX_GATEWAY_REDIS_URL"
API_KEY_ENV = "PREFIX_GATEWAY_API_KEY"
ADMIN_KEY_ENV = "PREFIX_GATEWAY_ADMIN_KEY"
# `serve`'s settings from the environment, for containers: each flag, when given, wins.
CONFIG_ENV = "PREFIX_GATEWAY_CONFIG"
HOST_ENV = "PREFIX_GATEWAY_HOST"
PORT_ENV = "PREFIX_GATEWAY_PORT"
LOG_LEVEL_ENV = "PREFIX_GATEWAY_LOG_LEVEL"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def redis_url(args: argparse.Namespace) -> str | None:
    """--redis-url, else the environment variable, else None (the file's, for serve)."""
    return args.redis_url or os.environ.get(REDIS_ENV) or None


def with_redis(config: GatewayConfig, url: str | None) -> GatewayConfig:
    """`config` with the Batch API's Redis at `url` (other redis keys kept)."""
    if url is None:
        return config
    kept = config.redis.model_dump() if config.redis else {}
    try:
        config.redis = RedisConfig.model_validate({**kept, "url": url})
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL {url!r}: must start with redis://, rediss:// "
                          "or unix://") from exc
    return config


def shown_url(url: str) -> str:
    from gateway.redis_link import shown_url as without_password  # redis-py: lazily

    return without_password(url)


def redis_banner(config: GatewayConfig) -> str:
    if config.redis is None:
        return ("prefix-gateway: no Redis: the Batch API (/v1/files, /v1/batches) is off; "
                f"turn it on with --redis-url redis://HOST:6379/0 or {REDIS_ENV}")
    shared = ("routing state shared with the gateways using it"
              if config.redis.shared_routing.enabled else "routing state not shared")
    return (f"prefix-gateway: Redis {shown_url(config.redis.url)} in use: the Batch API "
            f"(/v1/files, /v1/batches) is on, its lines run as traffic class "
            f"{config.batch_class!r}; {shared}")


def run_gateway(config: GatewayConfig, *, access_log: bool = False,
                log_level: str = "info", banner: str | None = None,
                config_path: str | None = None,
                prepare: Callable[[GatewayConfig], GatewayConfig] | None = None,
                sock: socket.socket | None = None, workers_dir: str | None = None,
                on_started: Callable[[], None] | None = None) -> None:
    """Serve the gateway until SIGINT/SIGTERM (uvicorn handles both gracefully).

    With `config_path`, the file is reloaded on SIGHUP and when it changes (gateway/reload.py),
    each time through `prepare` (the command line's overrides).

    The socket is bound first, so a port in use fails here (OSError) before anything claims
    to serve; `banner` ("serving on ...") is printed once the server has started on it.
    A worker of `serve --workers N` (gateway/supervisor.py) gets the listening `sock` its
    supervisor bound, the directory the workers share their figures in, and `on_started`,
    called once it serves.
    """
    import uvicorn

    from gateway.app import create_app
    from gateway.httpserver import ServerLimits, descriptor_cap, protocol_class

    problem = config.exposure_problem()
    if problem:  # every command that serves passes here
        raise ConfigError(problem)
    server = config.server
    own_socket = sock is None
    if sock is None:
        sock = bind_socket(server.host, server.port)
    limits = ServerLimits(
        max_header_bytes=server.max_header_bytes, max_headers=server.max_headers,
        header_timeout_s=server.header_timeout_s, body_timeout_s=server.body_timeout_s,
        keepalive_timeout_s=server.keepalive_timeout_s,
        max_connections=descriptor_cap(server.max_connections))
    reloader = None
    if config_path is not None:
        from gateway.reload import Reloader

        def reloader(fleet):
            return Reloader(config_path, fleet, fleet.state.metrics, prepare)

    app = create_app(config, reloader, workers_dir)
    server_cfg = uvicorn.Config(
        app,
        # Measured faster than asyncio + h11 (docs/benchmarks.md); httptools, bounded.
        loop="uvloop",
        http=protocol_class(limits),
        ws="none",
        access_log=access_log,
        # X-Forwarded-For only changes the client address the access log prints: without
        # the access log, the middleware's work on every request is for nothing.
        proxy_headers=access_log,
        log_level=log_level,
        timeout_keep_alive=int(server.keepalive_timeout_s) + 1,
        lifespan="on",
    )
    ignore_sighup()
    try:
        _server(server_cfg, banner, on_started).run(sockets=[sock])
    finally:
        if own_socket:
            sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; OSError (with the address) if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _ignored_sighup(_signum: int, _frame: object) -> None:
    log.warning("SIGHUP received and ignored: no configuration file to reload now (prefix-gateway "
                "up has none; serve reloads its file only while it serves)")


def ignore_sighup() -> None:
    """SIGHUP (a closed terminal, or a reload request) must never kill the gateway: while it
    serves, it reloads the configuration file (gateway/app.py); before and after, it is
    ignored."""
    signal.signal(signal.SIGHUP, _ignored_sighup)


def _server(config, banner: str | None, on_started: Callable[[], None] | None = None):
    """uvicorn's Server, printing `banner` (and calling `on_started`) only once it is
    listening."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and banner:
                print(banner, flush=True)
            if self.started and on_started is not None:
                on_started()

    return Server(config)


def up_auth(args: argparse.Namespace) -> dict | None:
    """The auth section `up` runs with: --api-key / --admin-key (or their environment
    variables), hashed at once; None without either."""
    from gateway.config import key_digest

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    if api_key is None and admin_key is None:
        return None
    auth: dict = {}
    if api_key:
        auth["api_keys"] = [{"name": "client", "key": key_digest(api_key.strip())}]
    if admin_key:
        auth["admin_keys"] = [{"name": "admin", "key": key_digest(admin_key.strip())}]
    return auth


def auth_banner(config: GatewayConfig) -> str:
    auth = config.auth
    if not auth.api_keys:
        return ("prefix-gateway: UNAUTHENTICATED: anyone who can reach "
                f"{config.server.host}:{config.server.port} may use every pool and the admin "
                f"API; give client keys with --api-key KEY (or {API_KEY_ENV}) and an admin key "
                f"with --admin-key KEY (or {ADMIN_KEY_ENV}), or auth.api_keys in a config file")
    admin = (f"{len(auth.admin_keys)} admin key(s)" if auth.admin_keys
             else "no admin key: /admin is refused")
    metrics = f"{len(auth.metrics_keys)} metrics key(s)" if auth.metrics_keys \
        else "/metrics open"
    return f"prefix-gateway: {len(auth.api_keys)} client key(s), {admin}, {metrics}"


def cmd_hash_key(args: argparse.Namespace) -> int:
    from gateway.config import key_digest

    key = args.key
    if key is None:
        # From stdin by default: a key on the command line lands in the shell's history.
        if sys.stdin.isatty():
            import getpass

            key = getpass.getpass("key: ")
        else:
            key = sys.stdin.read()
    key = key.strip()
    if not key:
        print("prefix-gateway hash-key: empty key", file=sys.stderr)
        return 2
    print(key_digest(key))
    return 0


def serve_overrides(args: argparse.Namespace) -> Callable[[GatewayConfig], GatewayConfig]:
    """What the command line changes in the file's configuration: applied at start and to
    each reload, so that a reload sees no change the file did not make."""
    url = redis_url(args)
    host = args.host or os.environ.get(HOST_ENV) or None
    port = args.port if args.port is not None else env_port()

    def prepare(config: GatewayConfig) -> GatewayConfig:
        config = with_redis(config, url)
        if host:
            config.server.host = host
        if args.allow_unauthenticated:
            config.auth.allow_unauthenticated = True
        if port is not None:
            config.server.port = port
        if args.workers is not None:
            config.server.workers = args.workers
        return config

    return prepare


def env_port() -> int | None:
    """PREFIX_GATEWAY_PORT as a port number, None when unset or empty."""
    value = os.environ.get(PORT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) > 65535:
        raise ConfigError(f"{PORT_ENV}={value!r}: not a port number (0-65535)")
    return int(value)


def serve_env(args: argparse.Namespace) -> str | None:
    """Fill `serve`'s --config and --log-level from the environment when not given; an
    error message, or None."""
    if args.config is None:
        args.config = os.environ.get(CONFIG_ENV) or None
        if args.config is None:
            return f"no configuration file: give --config FILE or set {CONFIG_ENV}"
    if args.log_level is None:
        level = os.environ.get(LOG_LEVEL_ENV, "").strip().lower() or "info"
        if level not in LOG_LEVELS:
            return f"{LOG_LEVEL_ENV}={level!r}: not one of {', '.join(LOG_LEVELS)}"
        args.log_level = level
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    problem = serve_env(args)
    if problem:
        print(f"prefix-gateway: {problem}", file=sys.stderr)
        return 2
    try:
        prepare = serve_overrides(args)
        config = prepare(load_config(args.config))
    except ConfigError as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 2
    problem = config.exposure_problem()
    if problem:
        print(f"prefix-gateway: refusing to serve: {problem}", file=sys.stderr)
        return 2
    if args.check:
        pools = ", ".join(f"{p.name} ({p.engine}, {len(p.replicas)} replicas"
                          + (f", {p.discovery.kind} discovery" if p.discovery else "") + ")"
                          for p in config.pools)
        print(f"{args.config}: valid; pools: {pools}; " + (
            f"Batch API on (Redis {shown_url(config.redis.url)}), routing state "
            + ("shared" if config.redis.shared_routing.enabled else "not shared")
            if config.redis else "Batch API off (no Redis)"))
        return 0
    print(auth_banner(config), flush=True)
    print(redis_banner(config), flush=True)
    banner = f"prefix-gateway: serving on http://{config.server.host}:{config.server.port}"
    if config.server.workers > 1:
        return serve_workers(args, config, prepare, banner)
    try:
        run_gateway(config, access_log=args.access_log, log_level=args.log_level,
                    banner=banner, config_path=args.config, prepare=prepare)
    except OSError as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 1
    return 0


def serve_workers(args: argparse.Namespace, config: GatewayConfig,
                  prepare: Callable[[GatewayConfig], GatewayConfig], banner: str) -> int:
    """`serve` with server.workers > 1: this process binds the port, then supervises the
    workers it forks (gateway/supervisor.py), each serving on the inherited socket."""
    from gateway.supervisor import Supervisor

    n = config.server.workers
    try:
        sock = bind_socket(config.server.host, config.server.port)
    except OSError as exc:
        print(f"prefix-gateway: {exc}", file=sys.stderr)
        return 1

    def worker(workers_dir: str, on_started: Callable[[], None]) -> None:
        # The file as it is now: a worker started again after a reload serves what the
        # others serve. If it became invalid meanwhile, the configuration the gateway
        # started with (the others keep theirs too).
        try:
            cfg = prepare(load_config(args.config))
            cfg.server.workers = n
        except ConfigError as exc:
            log.error("worker %d: the configuration file is invalid now (%s); starting on "
                      "the configuration the gateway started with", os.getpid(), exc)
            cfg = config
        run_gateway(cfg, access_log=args.access_log, log_level=args.log_level,
                    config_path=args.config, prepare=prepare, sock=sock,
                    workers_dir=workers_dir, on_started=on_started)

    try:
        return Supervisor(n, worker, banner).run()
    finally:
        sock.close()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_up(args: argparse.Namespace) -> int:
    from gateway import processes
    from gateway.defaults import default_config

    n_rt, n_bt = args.realtime_replicas, args.batch_replicas
    url = redis_url(args)
    auth = up_auth(args)
    batch = {k: v for k, v in (("concurrency", args.batch_concurrency),
                               ("lease_s", args.batch_lease_s)) if v is not None}
    # uvicorn re-raises SIGTERM after its graceful shutdown; with the default disposition the
    # process would die there, before the `finally` below stops the replicas it started.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="prefix-gateway-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list = []
    engines: list = []
    try:
        if args.engine == "sim":
            # Not the gateway's own port, which it binds only after the replicas are up.
            ports = processes.free_ports(n_rt + n_bt, avoid=[args.port])
            kinds = ["vllm"] * n_rt + ["trtllm"] * n_bt
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for i, (port, kind) in enumerate(zip(ports, kinds, strict=True)):
                cmd = [sys.executable, "-m", "backends.sim", "--port", str(port),
                       "--kind", kind, "--model", args.model, "--profile", args.profile,
                       "--time-scale", str(args.time_scale), "--name", f"sim-{kind}-{i}"]
                procs.append(processes.spawn(cmd, str(log_dir / f"sim-{i}.log")))
            processes.wait_healthy(urls, procs, deadline_s=60)
            config = default_config(urls[:n_rt], urls[n_rt:], port=args.port, model=args.model,
                                    redis_url=url, batch=batch, auth=auth)
            print(f"prefix-gateway: {n_rt + n_bt} simulated replicas up ({args.profile}, time "
                  f"scale {args.time_scale}); logs in {log_dir}", flush=True)
        else:
            from backends.vllm_cpu.launch import ensure_model, start_replicas

            model_dir = args.model_dir or ensure_model()
            print(f"prefix-gateway: starting {n_rt + n_bt} vLLM CPU replicas of {model_dir} "
                  "(about a minute each on two cores)...", flush=True)
            engines = start_replicas(n_rt + n_bt, model_dir=model_dir,
                                     base_port=args.engine_base_port,
                                     served_model_name=args.model, log_dir=str(log_dir),
                                     kv_cache_gib=args.kv_cache_gib, die_with_parent=True)
            urls = [h.url for h in engines]
            # Both pools are vLLM here: trtllm-serve cannot run without an NVIDIA GPU.
            config = default_config(urls[:n_rt], urls[n_rt:], port=args.port, model=args.model,
                                    batch_engine="vllm", redis_url=url, batch=batch,
                                    auth=auth)
            print(f"prefix-gateway: {len(urls)} vLLM CPU replicas up; logs in {log_dir}",
                  flush=True)
        print(auth_banner(config), flush=True)
        print(redis_banner(config), flush=True)
        run_gateway(config, access_log=args.access_log, log_level=args.log_level,
                    banner=f"prefix-gateway: serving on http://127.0.0.1:{args.port}  (model "
                           f"{args.model!r}; pools realtime and batch; header x-traffic-class: "
                           "batch for batch)")
    except (RuntimeError, OSError, ValueError, ConfigError) as exc:
        print(f"prefix-gateway up: {exc}", file=sys.stderr)
        return 1
    finally:
        processes.stop_all(procs)
        for engine in engines:
            engine.stop()
    return 0


def read_admin(command: str, args: argparse.Namespace, path: str) -> dict | None:
    """GET a running gateway's admin `path` with the admin key (--admin-key or the
    environment); None after saying on stderr why it could not be read."""
    import httpx

    url = args.url.rstrip("/") + path
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    headers = {"Authorization": f"Bearer {key.strip()}"} if key else {}
    try:
        resp = httpx.get(url, timeout=args.timeout, headers=headers)
        if resp.status_code in (401, 403):
            message = resp.json().get("error", {}).get("message", "") if resp.headers.get(
                "content-type", "").startswith("application/json") else ""
            print(f"prefix-gateway {command}: {url} refused: HTTP {resp.status_code}: {message} "
                  f"(give the admin key with --admin-key or {ADMIN_KEY_ENV})", file=sys.stderr)
            return None
        resp.raise_for_status()
        return resp.json()
    except httpx.HTTPError as exc:
        print(f"prefix-gateway {command}: cannot read {url}: {exc}", file=sys.stderr)
    except ValueError:
        print(f"prefix-gateway {command}: {url} did not answer JSON", file=sys.stderr)
    return None


def print_admin(command: str, args: argparse.Namespace, path: str,
                render: Callable[[Any], str]) -> int:
    """An admin GET printed as JSON (--json) or as `render` writes it; 1 if it failed."""
    data = read_admin(command, args, path)
    if data is None:
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(render(data), end="")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from gateway.stats import render_table

    return print_admin("stats", args, "/admin/stats", render_table)


def cmd_experiments(args: argparse.Namespace) -> int:
    from gateway.experiments.report import render_report

    return print_admin("experiments", args, "/admin/experiments", render_report)


def cmd_openapi(args: argparse.Namespace) -> int:
    from gateway.openapi import v1_openapi

    print(json.dumps(v1_openapi(args.server), indent=2))
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from backends.sim.cli import main_from_args

    return main_from_args(args) or 0


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return n


def build_parser(sim_options: bool = True) -> argparse.ArgumentParser:
    """The command's parser; without `sim_options`, `sim` is listed but takes no options
    (they come from the simulator, whose import costs every other command a quarter second)."""
    parser = argparse.ArgumentParser(prog="prefix-gateway", description=(
        "OpenAI-compatible gateway that routes shared-prefix traffic to the engine replica "
        "most likely to hold it in cache, within a bound on load."))
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, log_level: str | None = "info") -> None:
        p.add_argument("--access-log", action="store_true", help="log every request")
        p.add_argument("--log-level", default=log_level, choices=LOG_LEVELS,
                       help=None if log_level else f"default: {LOG_LEVEL_ENV}, else info")

    p = sub.add_parser("serve", help="serve with a configuration file")
    p.add_argument("--config", help=f"YAML file (see deploy/examples); default: {CONFIG_ENV}")
    p.add_argument("--host", help=f"override server.host (also {HOST_ENV})")
    p.add_argument("--port", type=int, help=f"override server.port (also {PORT_ENV})")
    p.add_argument("--workers", type=_positive, help="override server.workers: worker processes "
                   "sharing the port (default 1: one process, no supervisor)")
    p.add_argument("--check", action="store_true", help="validate the file and exit")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback host without client keys (auth."
                   "allow_unauthenticated): anyone who reaches it may use it")
    p.add_argument("--redis-url", help=f"Redis for the Batch API, rate limits and routing "
                   f"state shared between gateways, overriding redis.url (also {REDIS_ENV})")
    common(p, log_level=None)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="run the embedded default: two pools of local replicas")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--engine", choices=["sim", "vllm-cpu"], default="sim",
                   help="simulated replicas (default) or real vLLM CPU replicas")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--profile", default="llama-8b-h200",
                   help="latency profile of simulated replicas")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply simulated latencies (0.1 = ten times faster)")
    p.add_argument("--realtime-replicas", type=int, default=REALTIME_REPLICAS,
                   help="replicas in pool realtime")
    p.add_argument("--batch-replicas", type=int, default=BATCH_REPLICAS,
                   help="replicas in pool batch")
    p.add_argument("--model-dir", default=None,
                   help="vllm-cpu: model directory (default: a tiny local model, made if missing)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vllm-cpu: KV cache per replica")
    p.add_argument("--engine-base-port", type=int, default=8100, help="vllm-cpu: first port")
    p.add_argument("--log-dir", help="where replica logs go (default: a temporary directory)")
    p.add_argument("--redis-url", help=f"Redis for the Batch API, e.g. redis://127.0.0.1:6379/0 "
                   f"(also {REDIS_ENV}); without it the Batch API is off")
    p.add_argument("--batch-concurrency", type=int, default=None,
                   help="lines of one batch the gateway runs at once (batch.concurrency)")
    p.add_argument("--batch-lease-s", type=float, default=None,
                   help="lease of a running batch line, renewed while it runs (batch.lease_s)")
    p.add_argument("--api-key", help=f"the client API key /v1 requires (also {API_KEY_ENV}); "
                   "without it the gateway is unauthenticated (it binds 127.0.0.1 only)")
    p.add_argument("--admin-key", help=f"the key /admin and /admin/stats require (also "
                   f"{ADMIN_KEY_ENV})")
    common(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("stats", help="print a running gateway's routing stats")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--admin-key", help=f"the gateway's admin key (also {ADMIN_KEY_ENV})")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("experiments", help="print a running gateway's A/B experiments: both "
                       "arms side by side, the paired differences and the conditions")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait (the report computes bootstrap intervals)")
    p.add_argument("--admin-key", help=f"the gateway's admin key (also {ADMIN_KEY_ENV})")
    p.set_defaults(func=cmd_experiments)

    p = sub.add_parser("hash-key", help="print the sha256: digest of a key, for auth.*.key")
    p.add_argument("key", nargs="?", help="the key (default: read from stdin, so that it "
                   "stays out of the shell's history)")
    p.set_defaults(func=cmd_hash_key)

    p = sub.add_parser("openapi", help="print the OpenAPI document of the /v1 routes (JSON)")
    p.add_argument("--server", default=None,
                   help="the gateway's base URL to write into the document's servers")
    p.set_defaults(func=cmd_openapi)

    p = sub.add_parser("sim", help="run simulated engine replicas")
    if sim_options:
        from backends.sim.cli import add_sim_arguments

        add_sim_arguments(p)
    p.set_defaults(func=cmd_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # httpx logs every request at INFO; `stats` output must stay a clean table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands are matched exactly, so only `sim` as the first word needs its options.
    args = build_parser(sim_options=bool(argv) and argv[0] == "sim").parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
