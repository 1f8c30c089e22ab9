"""launch.generate's prompts: the --prompt, --prompts_file and --chat flags, read into Prompts
(read_prompts; UsageError naming the flag, and the file's line, on bad input), and encoded with
the target's tokenizer (encode_prompts)."""

import dataclasses
import json
import os

from absl import flags

from launch.usage import UsageError
from models.tokenizer import validate_messages

FLAGS = flags.FLAGS

flags.DEFINE_string("prompt", None, "A prompt text.")
flags.DEFINE_string(
    "prompts_file",
    None,
    'JSON Lines file, one object per line: {"prompt": TEXT}, or {"messages": [{"role": ROLE, '
    '"content": TEXT}, ...]}, a conversation always rendered with the target\'s chat template.',
)
flags.DEFINE_bool(
    "chat",
    False,
    "Each --prompt / prompts-file prompt is one user message, rendered with the target's chat "
    "template (a GGUF's tokenizer.chat_template) with the assistant's turn opened, as transformers' "
    "apply_chat_template renders it; the text is tokenized without adding a BOS (the template "
    "writes the one the model expects). A model without a template is refused.",
)

DEFAULT_PROMPT = "def fibonacci(n):\n    "


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: a text, or a conversation (`messages`) that the target's chat template renders."""

    text: str | None = None
    messages: tuple | None = None  # validated {"role", "content"} dicts
    where: str = "--prompt"  # what names it in an error: "--prompt", "--prompts_file line 3"

    @property
    def shown(self) -> str:
        """What the output names it by: the text, or the conversation's last message."""
        return self.text if self.messages is None else self.messages[-1]["content"]


def _as_chat(prompt: Prompt) -> Prompt:
    """--chat: a text prompt as one user message."""
    if prompt.messages is not None:
        return prompt
    return Prompt(messages=({"role": "user", "content": prompt.text},), where=prompt.where)


def read_prompts() -> list[Prompt]:
    """--prompt or --prompts_file as Prompts (with --chat, each text a user message); UsageError
    naming the flag (and the file's line) on bad input."""
    if FLAGS.prompt is not None and FLAGS.prompts_file is not None:
        raise UsageError("give --prompt or --prompts_file, not both")
    if FLAGS.prompts_file is not None:
        prompts = _read_prompts_file()
    else:
        prompts = [Prompt(text=DEFAULT_PROMPT if FLAGS.prompt is None else FLAGS.prompt)]
    return [_as_chat(p) for p in prompts] if FLAGS.chat else prompts


def _read_prompts_file() -> list[Prompt]:
    if not os.path.exists(FLAGS.prompts_file) or os.path.isdir(FLAGS.prompts_file):
        raise UsageError(f"--prompts_file: no such file: {FLAGS.prompts_file}")
    prompts = []
    with open(FLAGS.prompts_file, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"--prompts_file {FLAGS.prompts_file} line {number}: not UTF-8 "
                    f"(byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--prompts_file line {number}: not JSON ({e.msg})") from None
            where = f"--prompts_file line {number}"
            if isinstance(record, dict) and "prompt" in record and "messages" in record:
                raise UsageError(f'{where}: has both "prompt" and "messages"; give one')
            if isinstance(record, dict) and "messages" in record:
                try:
                    messages = validate_messages(record["messages"])
                except ValueError as e:
                    raise UsageError(f"{where}: {e}") from None
                prompts.append(Prompt(messages=tuple(messages), where=where))
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(Prompt(text=record["prompt"], where=where))
            else:
                raise UsageError(f'{where}: needs a string "prompt" field or a "messages" list')
    if not prompts:
        raise UsageError(f"--prompts_file: {FLAGS.prompts_file} has no prompts")
    return prompts


def encode_prompts(tokenizer, prompts: list[Prompt], target: str) -> tuple[list[list[int]], list[str]]:
    """(token ids, the text the model reads) of each prompt: a text as given (tokenizer.encode),
    a conversation rendered with the target's chat template and encoded with no BOS added
    (tokenizer.encode_chat: the template writes it). UsageError naming --target (`target`) where it
    has no template, and the prompt where its template refuses the conversation."""
    token_prompts, texts = [], []
    for p in prompts:
        if p.messages is None:
            token_prompts.append(tokenizer.encode(p.text))
            texts.append(p.text)
            continue
        try:
            texts.append(tokenizer.apply_chat_template(list(p.messages)))
            token_prompts.append(tokenizer.encode_chat(list(p.messages)))
        except ValueError as e:
            if tokenizer.chat_template is None:
                needs = "--chat" if FLAGS.chat else f'the "messages" of {p.where}'
                raise UsageError(f"{needs}: --target={target}: {e}") from None
            raise UsageError(f"{p.where}: {e}") from None
    return token_prompts, texts


def default_prompt_used() -> bool:
    """Whether neither --prompt nor --prompts_file was given (DEFAULT_PROMPT is the prompt)."""
    return FLAGS.prompt is None and FLAGS.prompts_file is None
