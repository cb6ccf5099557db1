"""The transformers integration: ``enable`` / ``install``, the call's session and plan, the certified step inside
transformers' decode loop, its processors, Whisper, beam search and assisted generation.

The only subpackage that imports transformers; every point where it touches transformers is listed in
:mod:`hf_csv.transformers.patches` (docs/design.md)."""
