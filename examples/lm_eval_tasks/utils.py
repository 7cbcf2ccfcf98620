"""Document filters of the local lm-eval tasks in this directory."""


def three_objects(dataset):
    """BIG-bench logical deduction questions about three objects that have answer choices."""
    return dataset.filter(lambda doc: doc["multiple_choice_targets"] and "three objects" in doc["inputs"])
