"""dflash-gateway: OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) in front of the DFlash
Triton server's `dflash_bls` model, over gRPC. FastAPI + uvicorn and the clients' transport; no torch.

`dflash-serve REPO --openai-port 9000` starts it beside tritonserver; `dflash-gateway --help` runs it alone.
"""
