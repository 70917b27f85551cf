"""Mutation testing of Megatron-FSDP: does the functional suite catch a regression it was not written
for? ``python -m bench.mutants`` (``make mutants``); the catalogue is ``bench/mutants/catalogue.py``."""
