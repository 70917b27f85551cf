"""The harness: launching and watching ranks. Imports nothing from ``fsdp`` or ``reporting``."""
