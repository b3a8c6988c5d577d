"""The sessions drafters are trained and evaluated on: the session format (:mod:`.schema`), the
synthetic agentic / code / chat generator (:mod:`.generator`) and one request per assistant turn,
rendered with the target's chat template (:mod:`.replay`)."""
