"""Which model class serves which architecture. Model classes describe themselves (config parsing,
weight names, KV layer specs); nothing here looks at model names beyond the architecture string a
checkpoint declares."""

from __future__ import annotations

from types import MappingProxyType

from ..errors import UserInputError
from .gemma3 import Gemma3ForCausalLM

# Hugging Face `architectures` entries of config.json.
HF_ARCHITECTURES = MappingProxyType({
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # text tower only; image inputs come later
})

# `general.architecture` of GGUF files.
GGUF_ARCHITECTURES = MappingProxyType({
    "gemma3": Gemma3ForCausalLM,
})


def model_class_for_hf(architectures: list[str] | None, model_type: str | None) -> type:
    for arch in architectures or []:
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    if not architectures and model_type in ("gemma3_text", "gemma3"):
        return Gemma3ForCausalLM
    raise UserInputError(
        f"unsupported architecture {architectures or model_type!r}; supported: {', '.join(HF_ARCHITECTURES)}")


def model_class_for_gguf(architecture: str | None) -> type:
    if architecture in GGUF_ARCHITECTURES:
        return GGUF_ARCHITECTURES[architecture]
    raise UserInputError(
        f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
