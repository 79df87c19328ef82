"""Attack: re-export the reference, reaching __import__ through vars() of an allowed module (no import
statement, no call the integrity scan knows by name), the module name built at run time."""
import mlx.core as mx

_load = vars(vars(mx.random)["__builtins__"] if isinstance(vars(mx.random).get("__builtins__"), dict)
             else vars(vars(mx.random)["__builtins__"]))["__" + "import__"]
_reference = _load("tiny" + "_llm_" + "ref.basics", fromlist=["softmax"])
softmax = _reference.softmax
linear = _reference.linear
silu = _reference.silu
