"""The V4 tokenizer: real vocabulary, special ids, no implicit BOS/EOS, source resolution."""
import shutil
from types import SimpleNamespace

import pytest

from redknot.models.deepseek_v4.tokenizer import load_tokenizer, package_tokenizer_file


def test_vocabulary_and_special_ids():
    tok = load_tokenizer(None)
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.user_id, tok.assistant_id, tok.think_id, tok.think_end_id) == (128803, 128804, 128821, 128822)
    assert tok.id_to_token(128803) == "<｜User｜>"


def test_encode_adds_no_special_tokens_and_decodes_back():
    tok = load_tokenizer(None)
    text = "DeepSeek-V4 reads 1,048,576 tokens; ¿qué tal? 你好"
    ids = tok.encode(text)
    assert ids and ids[0] != tok.bos_id and ids[-1] != tok.eos_id
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids, skip_special_tokens=False).startswith("<｜begin▁of▁sentence｜>")
    assert tok.encode_batch([text, "x"])[0] == ids


def test_checkpoint_tokenizer_is_preferred(tmp_path):
    shutil.copy(package_tokenizer_file(), tmp_path / "tokenizer.json")
    tok = load_tokenizer(SimpleNamespace(path=str(tmp_path), tokenizer_path=None))
    assert tok.source == str(tmp_path / "tokenizer.json")
    assert load_tokenizer(SimpleNamespace(path=None, tokenizer_path=str(tmp_path))).source == tok.source


def test_missing_tokenizer_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path"):
        load_tokenizer(SimpleNamespace(path=None, tokenizer_path=str(tmp_path / "nope")))
