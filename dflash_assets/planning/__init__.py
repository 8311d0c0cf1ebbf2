"""The corpus's cost plan before any GPU hour: what each stage will cost, measured where it can be.

``costs`` is the arithmetic (generation wall time, hidden-state cache bytes,
capture and training GPU-hours, offline vs online training; also ``dflash plan``);
``measurements`` measures what the arithmetic needs (the published completions,
the raw prompts, a throughput burst over the fleet, a pilot of real prompts);
``batch_costs`` prices the corpus on the in-process Transformers engine (its
generate calls replayed over the corpus's prompts, each priced by a cost model
of one call timed on this host);
``stage`` is the ``generation_plan`` stage: it chooses among those measurements,
with the fallbacks in one place, and returns the plan.
"""
