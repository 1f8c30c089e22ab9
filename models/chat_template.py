"""Chat templates compiled as transformers compiles them (utils/chat_template_utils.py,
_cached_compile_jinja_template): a sandbox whose templates cannot change the objects they are
given, trim_blocks and lstrip_blocks, loop controls, a `{% generation %}` block that renders its
body, and the globals and filter chat templates use. models.tokenizer.render_chat_template
imports this module when a chat is rendered (jinja2 costs about 80 ms of start-up).
"""

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Generation(jinja2.ext.Extension):
    # transformers marks the assistant's text with it (to mask training loss); here it only renders
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # not Jinja's own tojson, which escapes HTML characters (<, >, &, ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class TemplateDict:  # dict() without the class's attributes
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (CPython internals)
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot start with '_': {name!r}")


@functools.lru_cache(maxsize=8)
def compiled(template: str) -> jinja2.Template:
    """`template` compiled in the sandbox above; ValueError naming the line where it does not parse."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


def render(template: str, **variables) -> str:
    """`template` rendered with `variables`; ValueError with the template's own message where it
    refuses them (raise_exception, a sandbox violation)."""
    try:
        return compiled(template).render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template refused the messages: {e}") from None
