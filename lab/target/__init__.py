"""The tiny Qwen3 target every test and demo serves (``models/qwen3-tiny-stdlib``): its tokenizer
(:mod:`.tokenizer`), pre-training (:mod:`.train`), SFT (:mod:`.sft`), the long-context stage
(:mod:`.long`) and the evaluation by prompt length (:mod:`.evaluate`). ``make target`` runs it."""
