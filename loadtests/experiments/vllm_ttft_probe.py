"""Measure TTFT of one vLLM replica, cold (prefix not cached) vs warm (prefix cached).

Stdlib only. Streams POST /v1/completions and times the first SSE chunk that carries text.
For each trial a fresh prompt of about N tokens is made (a unique nonce leads it, so no KV
block of it can already be cached): it is sent once (cold), then the same prompt again
(warm: every full block is now cached), then the prompt with a new short suffix
("warm+suffix": shared prefix, new tail, as a gateway sees it). Prompt sizes are fitted with
POST /tokenize so they are exact in tokens. Bounded: ``trials`` x sizes x 3 requests.

    python -m loadtests.experiments.vllm_ttft_probe --url http://127.0.0.1:8100 --tokens 1000 2000
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse


def word_list(n: int = 2000) -> list[str]:
    """Lower-case words from this Python's stdlib sources (deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    words: dict[str, None] = {}
    for name in ("textwrap.py", "argparse.py", "difflib.py", "pydoc.py", "inspect.py",
                 "typing.py", "subprocess.py", "tarfile.py", "zipfile/__init__.py"):
        p = stdlib / name
        if p.is_file():
            for w in re.findall(r"\b[a-z]{3,11}\b", p.read_text(errors="replace")):
                words.setdefault(w)
        if len(words) >= n:
            break
    return list(words)[:n] or ["lorem", "ipsum", "dolor", "sit", "amet"]


def post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def count_tokens(base: str, model: str, prompt: str) -> int:
    return post_json(base + "/tokenize", {"model": model, "prompt": prompt})["count"]


def make_prompt(base: str, model: str, rng: random.Random, words: list[str], target: int,
                nonce: str) -> tuple[str, int]:
    """A prompt of exactly ``target`` tokens or a few fewer (fitted via /tokenize)."""
    n = max(1, target // 2)
    text = ""
    pool = [rng.choice(words) for _ in range(target * 2)]
    for _ in range(12):
        text = f"[{nonce}] " + " ".join(pool[:n])
        c = count_tokens(base, model, text)
        if target - 8 <= c <= target:
            return text, c
        n = max(1, int(n * target / max(c, 1)) - (1 if c > target else 0))
    return text, count_tokens(base, model, text)


def ttft(base: str, model: str, prompt: str, max_tokens: int = 4,
         timeout: float = 120.0) -> tuple[float, float]:
    """(seconds to the first text chunk, seconds to the end of the stream)."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "temperature": 0.0, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        if first is None:
            chunk = json.loads(data)
            if any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    return (first if first is not None else total), total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8100")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--suffix-tokens", type=int, default=32,
                    help="length of the new tail in the warm+suffix case (about)")
    ap.add_argument("--json", action="store_true", help="also print results as one JSON line")
    args = ap.parse_args(argv)
    base = args.url.rstrip("/")
    rng = random.Random(args.seed)
    words = word_list()
    ttft(base, args.model, "warm up the server", max_tokens=2)  # first-request overheads

    results = {}
    print(f"{'tokens':>7} {'case':<13} {'median ms':>10} {'min ms':>8} {'max ms':>8}  (n)")
    for target in args.tokens:
        rows: dict[str, list[float]] = {"cold": [], "warm": [], "warm+suffix": []}
        ntok = 0
        for t in range(args.trials):
            nonce = f"{args.seed}-{target}-{t}-{time.time_ns()}"
            prompt, ntok = make_prompt(base, args.model, rng, words, target, nonce)
            suffix = " " + " ".join(rng.choice(words) for _ in range(args.suffix_tokens // 2))
            rows["cold"].append(ttft(base, args.model, prompt)[0])
            rows["warm"].append(ttft(base, args.model, prompt)[0])
            rows["warm+suffix"].append(ttft(base, args.model, prompt + suffix)[0])
        results[target] = {"prompt_tokens": ntok}
        for case, xs in rows.items():
            ms = [x * 1000 for x in xs]
            results[target][case] = {"median_ms": round(statistics.median(ms), 1),
                                     "min_ms": round(min(ms), 1), "max_ms": round(max(ms), 1),
                                     "n": len(ms)}
            print(f"{ntok:>7} {case:<13} {statistics.median(ms):>10.1f} {min(ms):>8.1f} "
                  f"{max(ms):>8.1f}  ({len(ms)})", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
