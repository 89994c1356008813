"""Reference models in plain TF ops with dapple_tf.layer markers, and the registry the CLIs use.

    spec = models.get_model("vgg19", config="tiny", width_div=8)
    features, labels = spec.placeholders(batch_size=32)
    loss = spec.model_fn(features, labels)
    values = spec.synthetic_batch(32)

Models: mlp, vgg19, resnet50, bert, gnmt; configs `tiny` (tests) and `paper` (the paper's sizes).
"""

from models import bert, gnmt, mlp, resnet, vgg
from models.base import InputSpec, ModelSpec

_REGISTRY = {"mlp": mlp, "vgg19": vgg, "resnet50": resnet, "bert": bert, "gnmt": gnmt}
MODEL_NAMES = tuple(_REGISTRY)
CONFIGS = ("tiny", "paper")


def get_model(name, config="tiny", **overrides):
    """The ModelSpec of a registered model at a config, with config keys overridden."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    return _REGISTRY[name].make(config, **overrides)


def parse_model_flags(text):
    """'key=value,key=value' (lists as 'a:b:c') -> dict of strings."""
    flags = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"model flag {item!r} is not key=value")
        flags[key.strip()] = value.strip()
    return flags


__all__ = ["CONFIGS", "MODEL_NAMES", "InputSpec", "ModelSpec", "get_model", "parse_model_flags"]
