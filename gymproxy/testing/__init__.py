"""Test doubles for gymproxy's own tests and demos; nothing in the proxy imports them.

`fake_vllm.FakeVLLM` speaks vLLM 0.32's wire format, and in dev mode (VLLM_SERVER_DEV_MODE=1) its RL
routes: pause, resume, weight versions. `gymproxy serve` with no upstream starts it.
"""
