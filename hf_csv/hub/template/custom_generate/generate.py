"""Certified decoding with hf_csv, as a transformers ``custom_generate`` method.

Per call:   model.generate(**inputs, custom_generate="ORG/REPO", trust_remote_code=True)
Per model:  AutoModelForCausalLM.from_pretrained("ORG/REPO", trust_remote_code=True).generate(**inputs)

Both forms need ``trust_remote_code=True``: without it, transformers refuses the per-call form and the per-model form
silently runs stock ``generate``. The tokens are those of stock ``generate`` (greedy) or follow its law (sampling),
with the LM head computed on a certified sub-vocabulary; where hf_csv cannot prove a step it uses the full head and
says why (``model.csv_last_stats``).

This folder carries hf_csv itself (the ``csv_*.py`` and ``kern_*.py`` files next to this one, written by
``hf-csv push-model``; see ``hf_csv/hub/vendor.py`` in hf_csv's repository): nothing to install beyond transformers' own
dependencies (requirements.txt). ``csv_config=`` overrides the default below: a ``CSVConfig`` (this folder's, or an
installed hf_csv's, whose fields are copied) or a dict of its fields.
"""
import dataclasses

from .csv_core_config import CSVConfig
from .csv_transformers_enable import custom_generate as _custom_generate

# written by `hf-csv push-model`: the CSVConfig fields this repository defaults to (its own artifact)
CSV_CONFIG_DEFAULTS: dict = {}


def generate(*args, model, csv_config=None, **kwargs):
    # transformers passes the model by keyword (per model, positional arguments are generate's inputs)
    if csv_config is not None and not isinstance(csv_config, (CSVConfig, dict)):
        if not dataclasses.is_dataclass(csv_config):
            raise TypeError(f"csv_config must be a CSVConfig or a dict, got {type(csv_config).__name__}")
        csv_config = {f.name: getattr(csv_config, f.name) for f in dataclasses.fields(csv_config) if f.init}
    return _custom_generate(model, *args, csv_config=csv_config, defaults=CSV_CONFIG_DEFAULTS, **kwargs)
