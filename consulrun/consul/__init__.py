"""Speaking to a Consul agent: the HTTP transport, the client and its configuration, agent addresses,
and the translation of Consul's answers into consulrun's errors. The only package that speaks HTTP.

May import: the foundation (`consulrun.errors`, `consulrun.records`) and nothing else of ours.
Never click: every timer tick runs through here.
"""
