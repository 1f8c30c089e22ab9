"""What tests/test_serve.py and tests/test_serve_faults.py share: the tiny GGUF pair they serve
(a byte-level tokenizer with a chat template whose <|im_end|> is a control token, and a perturbed
copy as the draft) and `Server`, launch.serve's app over an Engine run by uvicorn in a thread of
this process on 127.0.0.1 and a free port, configured as the command line configures it."""

import json
import threading
import time

import httpx2
import openai
import tiny_gguf
from conftest import perturbed

import models
from experiments.bench_serve import free_port, prometheus_values
from launch.serve import GracefulServer, Limits, Service, make_app, uvicorn_config, warm_up
from launch.serve_engine import Metrics
from spec_jax.engine import Engine

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Server:
    """make_app over an Engine (warmed first: every row bucket compiled), served by launch.serve's
    GracefulServer in a thread of this process on 127.0.0.1, with `limits`, a keep-alive timeout
    of keep_alive_s and a SIGTERM grace period of `grace` (handle_exit(signal.SIGTERM, None)
    starts it: no real signal reaches a server off the main thread)."""

    def __init__(self, engine: Engine, limits: Limits | None = None, keep_alive_s: int = 5, grace: float = 0):
        limits = limits or Limits()
        warm_up(engine)
        self.engine = engine
        self.metrics = Metrics(MODEL)
        self.service = Service(MODEL, self.metrics, limits)
        self.worker = self.service.serve_engine(engine)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(make_app(self.service), "127.0.0.1", self.port, limits, keep_alive_s, grace)
        self.uvicorn = GracefulServer(config, self.service, grace)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def post(self, path: str, body, **kwargs) -> httpx2.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx2.post(self.url + path, content=content, timeout=60, **kwargs)

    def health(self) -> httpx2.Response:
        return httpx2.get(self.url + "/health", timeout=30)

    def metric(self, name: str) -> float:
        return prometheus_values(self.url).get(name, 0.0)

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.worker.shutdown(0)
        self.worker.join(30)


def tiny_pair(folder):
    """(the GGUF's path, the target loaded from it, a perturbed copy as the draft), written and
    converted in `folder`."""
    path = folder / "tiny.gguf"
    tiny_gguf.write(path, chat_template=CHAT_TEMPLATE, add_bos=True)
    target = models.load(str(path), cache_dir=path.parent / "cache", progress=False)  # not the user's cache
    return path, target, perturbed(target, 0.1, seed=7)
