"""Text calibration in Python is cut into windows of max_length tokens, as the command line cuts its text: no token
of a long string is dropped; token ids longer than max_length are cut with a warning."""

import pytest
import torch

import jgptq
from jgptq_torch.cli.demo import byte_tokenizer
from jgptq_torch.pipeline import calib
from tests.tiny_models import build

TEXT = "".join(f"line {k}: the quick brown fox jumps over the lazy dog.\n" for k in range(40))   # 2,110+ bytes


def test_one_long_text_becomes_windows_of_max_length_with_every_token():
    tok = byte_tokenizer()
    ids = torch.tensor(tok(TEXT)["input_ids"])
    rows = calib.sequences(TEXT, tok, max_length=512)
    assert [i.shape[0] for i, _ in rows] == [512] * (ids.numel() // 512) + [ids.numel() % 512]
    assert torch.equal(torch.cat([i for i, _ in rows]), ids)                     # nothing dropped, in order
    # the whole windows are the command line's cut of the same tokens
    assert torch.equal(torch.stack([i for i, _ in rows[:-1]]), calib.cut_windows(ids, 512, 1000))
    assert calib.token_count(calib.batches(TEXT, tokenizer=tok, max_length=512)) == ids.numel()


def test_quantize_moe_calibrates_on_all_of_a_long_text():
    tok = byte_tokenizer()
    n = len(tok(TEXT)["input_ids"])
    result = jgptq.quantize_moe(build("llama", vocab_size=256), TEXT, tokenizer=tok, method="rtn", max_length=64, group_size=32,
                                batch_size=64, progress=False)
    assert result.report.calibration_tokens == n > 64


def test_token_ids_longer_than_max_length_are_cut_with_a_warning():
    with pytest.warns(UserWarning, match=r"^2 calibration sequences longer than max_length=4 cut to it \(7 tokens "
                                         r"dropped\); pass text with a tokenizer"):
        rows = calib.sequences([torch.arange(8), torch.arange(3), torch.arange(7)], max_length=4)
    assert [i.shape[0] for i, _ in rows] == [4, 3, 4]
