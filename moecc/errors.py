"""Exceptions moecc raises for input it cannot honour. Each message says what was seen and what to do."""


class MoeccError(ValueError):
    """Base class: a model, configuration or input moecc cannot use as given."""


class UnsupportedModelError(MoeccError):
    """The model has no MoE family moecc knows, or a layout it cannot run."""


class UnsupportedLoraConfigError(MoeccError):
    """The LoRA configuration asks for something the engine cannot compute exactly."""


class UnsupportedDtypeError(MoeccError):
    """Weights or activations in a dtype the engine does not support."""


class AdapterMismatchError(MoeccError):
    """An adapter directory that does not fit the model it is loaded into."""
