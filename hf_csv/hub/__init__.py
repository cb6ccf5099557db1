"""The Hub layer: the screen artifact (config + safetensors), its transport, the ``hf-csv`` CLI and the
``custom_generate`` template with its vendored copy of hf_csv (docs/hub.md)."""
