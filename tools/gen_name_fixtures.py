"""Writes tiny_mixed's weights under the tensor names HF transformers 5.23.0 actually writes.

`save_pretrained` reverses HF's official->HF key conversion on save, and what it writes depends on
how the model was built: a model constructed in memory and one loaded from an HF-named checkpoint
give different names. The loader must accept both; these files pin them down.

Usage (same venv as gen_fixtures.py): python tools/gen_name_fixtures.py
Writes tests/fixtures/hf/names/{default_save,resave}/ (config.json + model.safetensors).
"""
import json, os, shutil, sys
import torch
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

root = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
src = os.path.join(root, "tiny_mixed")
out = os.path.join(root, "names")

# 1. Loaded from the HF-named fixture, saved with defaults.
m = DeepseekV4ForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
m.save_pretrained(os.path.join(out, "resave"))

# 2. Constructed in memory from the config, weights copied in, saved with defaults.
cfg = DeepseekV4Config.from_pretrained(src)
m2 = DeepseekV4ForCausalLM(cfg).to(torch.float32)
sd = load_file(os.path.join(src, "model.safetensors"))
missing, unexpected = m2.load_state_dict(sd, strict=True), None
m2.save_pretrained(os.path.join(out, "default_save"))

for d in ("resave", "default_save"):
    p = os.path.join(out, d)
    for f in os.listdir(p):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(p, f))
    names = sorted(load_file(os.path.join(p, "model.safetensors")).keys())
    print(d, len(names), [n for n in names if "layers.1." in n][:12])
