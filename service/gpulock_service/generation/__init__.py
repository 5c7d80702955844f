"""Text generation for the service's ``/v1/chat/completions`` and ``/v1/completions``, apart
from HTTP and from leases: a generation is a pure step, prompt token ids in, an iterator of
text pieces out, each ``next()`` running a few forward passes (blocking: the caller runs it in
the integration's executor, under the request's lease).

* ``tiny``: the default model, a small causal LM with random weights built from a config on
  first use (its text is meaningless);
* ``causal_lm``: a local Hugging Face causal-LM folder loaded with ``AutoModelForCausalLM``
  (:class:`CausalLM`): its tokenizer, prompts, context and shape (``gpulock.estimates``);
* ``decode``: the token loop over the KV cache, greedy or sampled, in chunks;
* ``text``: token chunks to text pieces: incremental detokenizing and stop sequences;
* ``growth``: the steps under a lease that follows the KV cache (what to lease first, when
  to grow it), given what the lease holds and how to grow it;
* ``bodies``: the OpenAI request bodies and their checks, and the lease's sizes;
* ``shapes``: the OpenAI response objects and stream chunks.
* ``telemetry``: OpenTelemetry's ``gen_ai.*`` attributes of a generation, on its call's span.

Importing this package imports neither torch nor transformers.
"""
