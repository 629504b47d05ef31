"""Runtime: what runs when an installed model is called. Each host's forward is a ``GraphForward``
(``graph_forward``) holding one graph per call signature (``call_signature``); what happens at a call of a new
signature is in one place, ``recapture``: the host's template is captured and analysed again for that call, or the
host's own forward serves it with its widths kept in step (``own_forward``), or the call is refused naming the
arguments."""
