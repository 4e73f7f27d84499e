"""The random-weight stand-in for the default model (GPU benchmark runs, where its file is absent)
has exactly the default model's shapes."""

from __future__ import annotations

import dataclasses

from loraplex.engine.loader import DUMMY_CONFIGS, load_config
from loraplex.model_config import ModelConfig


def test_smollm2_shapes_match_the_converted_default_model(model_path):
    real = ModelConfig.from_hf_config(load_config(model_path))
    dummy = ModelConfig.from_hf_config(DUMMY_CONFIGS["smollm2-135m-shapes"])
    differ = {f.name: (getattr(real, f.name), getattr(dummy, f.name)) for f in dataclasses.fields(ModelConfig)
              if getattr(real, f.name) != getattr(dummy, f.name)}
    # eps: the converted config holds 1e-5 rounded through fp32 (9.9999997e-06)
    assert set(differ) <= {"rms_norm_eps"}, differ
    assert abs(real.rms_norm_eps - dummy.rms_norm_eps) < 1e-12
