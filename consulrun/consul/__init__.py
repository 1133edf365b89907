"""Speaking to a Consul agent: the HTTP transport, the client and its configuration, agent addresses,
the translation of Consul's answers into consulrun's errors, and the one check of every KV value read
(`values`, which also escapes text from Consul for terminals). The only package that speaks HTTP to Consul.

May import: the foundation (`consulrun.errors`, `consulrun.records`) and nothing else of ours.
Never click: every timer tick runs through here.
"""
