"""TooLong, the error of both tokenizers' encode(at_most=): models.tokenizer.Tokenizer's and the
random presets' models.ByteTokenizer. Its own module so that models/__init__.py imports it at
the top without models.tokenizer (which imports tokenizers and, through models.chat_template,
jinja2: start-up the package keeps off `import models`)."""


class TooLong(ValueError):
    """encode / encode_chat with `at_most`: the text has more tokens than that, as min_tokens
    proves without tokenizing. .at_least: min_tokens' count; .size: the text's UTF-8 bytes;
    .longest: the most bytes one token covers."""

    def __init__(self, at_least: int, at_most: int, size: int, longest: int):
        super().__init__(
            f"{size} bytes are at least {at_least} tokens (a token covers at most {longest} bytes), "
            f"more than {at_most}"
        )
        self.at_least, self.size, self.longest = at_least, size, longest
