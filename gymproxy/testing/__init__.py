"""Test doubles for gymproxy's own tests and demos; nothing in the proxy imports them.

`fake_vllm.FakeVLLM` speaks vLLM 0.32's wire format. `gymproxy serve` with no upstream starts it.
"""
