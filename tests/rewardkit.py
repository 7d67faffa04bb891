"""A test-only reward for rounds of the tiny random model, which never writes a parsable answer: `token_parity`
varies between its completions, so the policy gets a gradient. Imported by the tests and by test_trainer's launcher
script (a subprocess), so the reward is written once."""


def token_parity(completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
