"""The public API: judge a kernel of your own against the reference (``testing``), turn a plain
callable into a judged entry (``callable_entry``), the output contract of a stage, the policy
search behind ``explain``, the cross-engine checks, and the ``dsv4_numerics.kernels`` entry-point
group (``external``)."""
