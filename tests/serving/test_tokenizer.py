from transformers import AutoTokenizer

from serving.tokenizer import LightTokenizer

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
