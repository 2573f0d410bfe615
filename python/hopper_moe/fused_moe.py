def fused_experts(): pass
def fused_moe(): pass
def fused_topk(): pass
