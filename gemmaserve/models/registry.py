"""Which model class serves which architecture. Model classes describe themselves (config parsing,
weight names, KV layer specs); nothing here looks at model names beyond the architecture string a
checkpoint declares."""

from __future__ import annotations

from types import MappingProxyType

from ..errors import UserInputError
from .gemma3 import Gemma3ForCausalLM
from .gemma3_vision import Gemma3ForConditionalGeneration
from .gemma4 import Gemma4ForCausalLM
from .gemma4_unified import Gemma4UnifiedForConditionalGeneration
from .gemma4_vision import Gemma4ForConditionalGeneration

# Hugging Face `architectures` entries of config.json.
HF_ARCHITECTURES = MappingProxyType({
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Gemma4UnifiedForCausalLM": Gemma4ForCausalLM,
    "Gemma4UnifiedForConditionalGeneration": Gemma4UnifiedForConditionalGeneration,
})

# `model_type` of configs that name no architecture.
HF_MODEL_TYPES = MappingProxyType({
    "gemma3": Gemma3ForCausalLM, "gemma3_text": Gemma3ForCausalLM,
    "gemma4": Gemma4ForCausalLM, "gemma4_text": Gemma4ForCausalLM,
    "gemma4_unified": Gemma4ForCausalLM, "gemma4_unified_text": Gemma4ForCausalLM,
})

# `general.architecture` of GGUF files.
GGUF_ARCHITECTURES = MappingProxyType({
    "gemma3": Gemma3ForCausalLM,
    "gemma4": Gemma4ForCausalLM,
})


def model_class_for_hf(architectures: list[str] | None, model_type: str | None) -> type:
    for arch in architectures or []:
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    if not architectures and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise UserInputError(
        f"unsupported architecture {architectures or model_type!r}; supported: {', '.join(HF_ARCHITECTURES)}")


def model_class_for_gguf(architecture: str | None) -> type:
    if architecture in GGUF_ARCHITECTURES:
        return GGUF_ARCHITECTURES[architecture]
    if architecture == "clip":   # llama.cpp's mmproj files hold only the vision/audio encoders
        raise UserInputError("this GGUF file is a multimodal projector (mmproj: vision/audio encoders only), not a "
                             "language model: pass the model's own .gguf file as the model")
    raise UserInputError(
        f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
