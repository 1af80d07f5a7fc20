"""Tokenizers from an HF directory or a GGUF file, always with a chat template.

An HF directory goes through `AutoTokenizer.from_pretrained(dir)`. A GGUF file goes through
transformers' own GGUF support (`from_pretrained(dir, gguf_file=name)`), which rebuilds a fast
tokenizer from the file's `tokenizer.ggml.*` metadata (tokens, merges, token types, bos/eos) and its
`tokenizer.chat_template`. Everything is local: nothing is fetched from a hub.
"""
from __future__ import annotations

import os

import transformers

_NO_TEMPLATE_HELP = (
    "tokenizer at {path!r} has no chat template; the rollout frames every turn with it. Supply one with "
    "load_tokenizer(path, chat_template=TEMPLATE) where TEMPLATE is the jinja text or the path to a "
    ".jinja file (e.g. a Qwen-style '<|im_start|>{{{{ role }}}}\\n...<|im_end|>' template), or add "
    "'chat_template' to the directory's tokenizer_config.json / a chat_template.jinja file."
)


def load_tokenizer(path: str | os.PathLike, *, chat_template: str | os.PathLike | None = None,
                   require_chat_template: bool = True) -> transformers.PreTrainedTokenizerBase:
    """Load a tokenizer from an HF model directory or a `.gguf` file.

    chat_template: jinja text, or a path to a file holding it; replaces the tokenizer's own.
    require_chat_template: raise a ValueError explaining how to supply one when there is none.
    A tokenizer without a pad token gets its eos token as pad (batches are right-padded and the
    padding is masked by position, so its id never matters).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        try:
            tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        except Exception as e:  # transformers' GGUF converter covers llama/qwen2-style BPE vocabularies
            raise ValueError(f"could not build a tokenizer from the GGUF metadata of {path!r}: {e}. Point "
                             "load_tokenizer at the HF directory of the same model instead.") from e
    elif os.path.isdir(path):
        try:
            tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"could not load a tokenizer from the directory {path!r} (expected "
                             f"tokenizer.json / tokenizer_config.json): {e}") from e
    else:
        raise FileNotFoundError(f"no tokenizer at {path!r}: expected an HF model directory or a .gguf file.")

    if chat_template is not None:
        template = os.fspath(chat_template)
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tok.chat_template = template
    if require_chat_template and not tok.chat_template:
        raise ValueError(_NO_TEMPLATE_HELP.format(path=path))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
