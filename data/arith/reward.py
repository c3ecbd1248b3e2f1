"""Example custom reward function for the arithmetic set (verl's signature).

Used by config/arith_grpo.yaml through ``reward.custom_reward_function.path`` and ``.name``.
1.0 for the right integer, 0.1 for a wrong integer (the format is right), 0.0 otherwise.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Score one answer text against the row's ground truth."""
    text = solution_str.strip().rstrip(".")
    try:
        value = int(text)
    except ValueError:
        return 0.0
    return 1.0 if str(value) == str(ground_truth).strip() else 0.1
