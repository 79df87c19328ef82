"""Attack: the day's attention module re-exports the reference the same way as basics.py."""
import numpy as np

_builtins = vars(np)["__builtins__"]
_load = (_builtins if isinstance(_builtins, dict) else vars(_builtins))["__" + "import__"]
_reference = _load("tiny" + "_llm_" + "ref.attention", fromlist=["scaled_dot_product_attention_simple"])
scaled_dot_product_attention_simple = _reference.scaled_dot_product_attention_simple
SimpleMultiHeadAttention = _reference.SimpleMultiHeadAttention
