"""The course's package: a Qwen2 model and its serving path, built from mlx.core operations.

`src_ref/tiny_llm_ref` is the reference solution; `src/tiny_llm` is yours, written from it by
`maint/make_skeleton.py` with every task's body replaced by a TODO. Modules are imported by name
(`attention`, `qwen2_week1`, ...); this file imports none of them, so the test harness can swap
any one module for the other package's.
"""
