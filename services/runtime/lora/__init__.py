"""LoRA adapters served beside the base model: PEFT adapters read and checked (adapter.py),
their weights in per-module stacks indexed by slot (stacks.py), the resident slots and which
adapter holds each (registry.py), and one step's per-row slots (batch.py)."""
