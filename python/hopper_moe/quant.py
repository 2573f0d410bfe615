class QuantConfig: pass
