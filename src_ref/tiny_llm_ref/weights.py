"""Loading glue (provided, the same in the skeleton): turn mlx-lm layers into plain float weights."""

import mlx.core as mx


def dequantize_linear(mlx_layer) -> mx.array:
    """The float weight (`out x in`) of an mlx-lm layer: nn.Linear, nn.Embedding or their quantized forms.

    A quantized layer stores its weight packed into integers, with one scale (and bias) per group of
    `group_size` input features; mx.dequantize unpacks it to scale * q + bias. A float layer's
    weight is returned as it is.
    """
    scales = getattr(mlx_layer, "scales", None)
    if scales is None:
        return mlx_layer.weight
    return mx.dequantize(
        mlx_layer.weight,
        scales,
        getattr(mlx_layer, "biases", None),
        group_size=mlx_layer.group_size,
        bits=mlx_layer.bits,
        mode=getattr(mlx_layer, "mode", "affine"),
    )


def bias_of(mlx_layer) -> mx.array:
    """The bias of an mlx-lm linear layer, or zeros when it has none.

    Qwen2's q, k and v projections have biases; Llama-family checkpoints (SmolLM2) have none, which is
    the same as a bias of zeros, so one attention serves both.
    """
    if "bias" in mlx_layer:
        return mlx_layer["bias"]
    scales = getattr(mlx_layer, "scales", None)
    dtype = mlx_layer.weight.dtype if scales is None else scales.dtype  # a packed weight is uint32
    return mx.zeros((mlx_layer.weight.shape[0],), dtype=dtype)
