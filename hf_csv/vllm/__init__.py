"""The vLLM plugin (the ``vllm.general_plugins`` entry point): the only subpackage that imports vLLM, on the core only
(docs/vllm.md)."""
