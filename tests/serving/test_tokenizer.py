import pytest
from transformers import AutoTokenizer

from edgeflow.serving.tokenizer import LightTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke about café owners 🙂"}],
]


def test_light_tokenizer_matches_transformers(teacher_dir):
    hf = AutoTokenizer.from_pretrained(teacher_dir)
    light = LightTokenizer(teacher_dir)
    assert light.eos_token_id == hf.eos_token_id == 2
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert light.apply_chat_template(msgs, add_generation_prompt=gen) == expected
        text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert light(text)["input_ids"] == ids
        assert light.decode(ids) == hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "gemma3_text"])
def test_each_family_template_renders_as_transformers_does(model_type, tmp_path):
    """The server renders a family's own template (Llama 3 headers, Mistral [INST], ChatML, Gemma turns) and stops at
    its end token exactly as transformers does; a role the template refuses is a ValueError naming the role, which the
    chat endpoint returns as a 400."""
    from tests.helpers.families import FAMILY_TOKENS, family_tokenizer

    d = family_tokenizer(model_type, tmp_path / model_type)
    hf, light = AutoTokenizer.from_pretrained(d), LightTokenizer(d)
    assert light.eos_token_id == hf.convert_tokens_to_ids(FAMILY_TOKENS[model_type][2])
    for msgs in CONVERSATIONS:
        if model_type == "mistral" and msgs[0]["role"] == "system":
            with pytest.raises(ValueError, match="user and assistant roles only"):
                light.apply_chat_template(msgs)
            continue
        expected = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert light.apply_chat_template(msgs, add_generation_prompt=True) == expected
        assert light(expected)["input_ids"] == hf(expected, add_special_tokens=False)["input_ids"]
    if model_type == "gemma3_text":  # no system role in Gemma: folded into the first user turn, as its template documents
        assert "<start_of_turn>user\nBe brief.\n\nName a fruit." in light.apply_chat_template(CONVERSATIONS[1])
