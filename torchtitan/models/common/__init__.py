"""Building blocks shared by the model families: math only, no parallelism.

``decoder.Decoder`` is the skeleton every dense decoder family fills in (embedding, numbered
blocks, final norm, output), and the contract the generic parallelisms rely on: tensor parallel
plans, the pipeline split and FSDP name these attributes. ``hf_adapter`` maps a family's state dict
to the names ``transformers`` uses.
"""
