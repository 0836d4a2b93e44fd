"""What the vLLM CPU launcher decides before it starts an engine (backends/vllm_cpu/launch.py)."""

from __future__ import annotations

from backends.vllm_cpu.launch import GiB, cpu_dtype, kv_bytes_per_token, plan_cpu_binding

AVX2_ONLY = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""


def test_bfloat16_only_where_the_cpu_computes_in_it() -> None:
    # On an AVX2-only CPU vLLM's bfloat16 linear layers fall back to a path about 6x slower
    # than float32.
    assert cpu_dtype(AVX2_ONLY) == "float32"
    assert cpu_dtype("flags\t\t: avx2 avx512f avx512_bf16\n") == "bfloat16"
    assert cpu_dtype("flags\t\t: avx2 amx_tile amx_bf16\n") == "bfloat16"
    assert cpu_dtype("flags\t\t: avx2 avx512f avx512bw\n") == "float32"


def test_several_replicas_get_disjoint_cores() -> None:
    assert plan_cpu_binding(1, [0, 1]) == [None]
    assert plan_cpu_binding(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert plan_cpu_binding(3, [0, 1]) == ["0", "1", "0"]


def test_kv_bytes_per_token_follow_the_dtype_and_the_layers() -> None:
    # The launcher runs replicas in float32 on CPUs without bfloat16: sized for bfloat16,
    # vllm_bench gave them memory for half the blocks it capped them at. At 1 GiB the default
    # model's engine reports 65,536 tokens in bfloat16 and 32,768 in float32.
    assert kv_bytes_per_token(dtype="bfloat16") * 65_536 == GiB
    assert kv_bytes_per_token(dtype="float32") * 32_768 == GiB
    assert kv_bytes_per_token(24, "float32") == 3 * kv_bytes_per_token(dtype="float32")
