"""The penalties against the formulas they follow: TGI's frequency penalty, OpenAI's, CTRL's."""
import torch

from shard.penalties import apply_penalties
from shard.sampling import SamplingBatch, SamplingParams

CPU = torch.device("cpu")


def _tgi_frequency(scores: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    """TGI's HeterogeneousFrequencyPenaltyLogitsProcessor, one row without padding: each token's
    count over the whole sequence (prompt and output) over its length, times the penalty, off the
    logits."""
    share = torch.zeros_like(scores)
    share.scatter_add_(0, torch.tensor(ids), torch.ones(len(ids)))
    return scores - penalty * share / len(ids)


def _openai(scores: torch.Tensor, output: list[int], frequency: float, presence: float):
    """OpenAI's: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counting the output."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=scores.shape[0])
    return scores - counts * frequency - (counts > 0).float() * presence


def test_tgi_frequency_penalty_matches_tgis_formula_beside_openais_row():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 50, generator=generator)
    prompt = torch.randint(0, 50, (17,), generator=generator).tolist()
    output = torch.randint(0, 50, (9,), generator=generator).tolist()
    params = [SamplingParams(frequency_penalty=1.3, frequency_by_share=True),
              SamplingParams(frequency_penalty=1.3, presence_penalty=0.5),
              SamplingParams(frequency_penalty=-0.7, frequency_by_share=True)]
    batch = SamplingBatch.from_params(params, CPU)
    got = apply_penalties(scores, batch, [(prompt, output)] * 3)
    torch.testing.assert_close(got[0], _tgi_frequency(scores[0], prompt + output, 1.3))
    torch.testing.assert_close(got[1], _openai(scores[1], output, 1.3, 0.5))
    torch.testing.assert_close(got[2], _tgi_frequency(scores[2], prompt + output, -0.7))


def test_tgis_form_counts_the_prompt_before_any_output():
    scores = torch.zeros(1, 4)
    batch = SamplingBatch.from_params([SamplingParams(frequency_penalty=2.0,
                                                      frequency_by_share=True)], CPU)
    got = apply_penalties(scores, batch, [([1, 1, 2, 3], [])])
    # token 1 is half of the sequence: 2.0 * 0.5 off; 2 and 3 a quarter each
    assert got.tolist() == [[0.0, -1.0, -0.5, -0.5]]
    openai = SamplingBatch.from_params([SamplingParams(frequency_penalty=2.0)], CPU)
    assert apply_penalties(scores, openai, [([1, 1, 2, 3], [])]).tolist() == [[0.0] * 4]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    scores = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    batch = SamplingBatch.from_params([SamplingParams(repetition_penalty=2.0)], CPU)
    got = apply_penalties(scores, batch, [([0], [1])])
    assert got.tolist() == [[1.0, -2.0, 1.5, 0.5]]
