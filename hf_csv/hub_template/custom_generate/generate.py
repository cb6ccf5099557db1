"""Certified decoding with hf_csv, as a transformers ``custom_generate`` method.

Per call:   model.generate(**inputs, custom_generate="ORG/REPO", trust_remote_code=True)
Per model:  AutoModelForCausalLM.from_pretrained("ORG/REPO", trust_remote_code=True).generate(**inputs)

The tokens are those of stock ``generate`` (greedy) or follow its law (sampling), with the LM head
computed on a certified sub-vocabulary; where hf_csv cannot prove a step it uses the full head and
says why (``model.csv_last_stats``). Pass ``csv_config=hf_csv.CSVConfig(...)`` to override the default
below. Needs the ``hf_csv`` package (requirements.txt).
"""
# written by `hf-csv push-model`: the CSVConfig fields this repository defaults to (its own artifact)
CSV_CONFIG_DEFAULTS: dict = {}


def generate(*args, model, csv_config=None, **kwargs):
    # transformers passes the model by keyword (per model, positional arguments are generate's inputs)
    try:
        import hf_csv
    except ImportError as e:  # transformers checks requirements.txt first; this covers a bypassed check
        raise ImportError("this repository's custom_generate runs hf_csv certified decoding: pip install hf_csv") from e
    return hf_csv.custom_generate(model, *args, csv_config=csv_config, defaults=CSV_CONFIG_DEFAULTS, **kwargs)
