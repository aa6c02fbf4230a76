"""A Hugging Face model's config as graph metadata (`metadata["hf_config"]`): what export writes as config.json.

The profiler records it when it traces a transformers model, so the graph (and every checkpoint, which
records the graph) says how to rebuild the model without the original config file. Data only: a dict
of JSON values, read back by transformers' own `PretrainedConfig` (no code named by it is run).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

HF_CONFIG = "hf_config"  # graph.metadata key


def hf_config_dict(model: Any) -> Optional[dict[str, Any]]:
    """A Hugging Face model's config as JSON data naming its class in `architectures`; None for other models."""
    transformers = sys.modules.get("transformers")  # not imported: the model cannot be a transformers one
    config = getattr(model, "config", None)
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    data: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
    data["architectures"] = [type(model).__name__]  # the class the graph was traced from, as save_pretrained does
    return data
