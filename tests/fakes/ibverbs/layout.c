/* Prints the size and offsets of the verbs.h structs kvring declares itself
 * (src/transport/rdma/ibverbs/ffi.rs); .ci/stage-fakeverbs.sh compiles it
 * against the installed headers and compares with layout.expected, which a
 * unit test compares with the Rust declarations. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stddef.h>
#define S(t) printf(#t " %zu\n", sizeof(struct t));
#define O(t,f) printf(#t "." #f " %zu\n", offsetof(struct t, f));
int main(){S(ibv_context)S(ibv_qp)S(ibv_cq)S(ibv_send_wr)S(ibv_wc)S(ibv_qp_attr)S(ibv_port_attr)S(ibv_device_attr)S(ibv_srq)S(ibv_mr)S(ibv_qp_init_attr)S(ibv_recv_wr)S(ibv_async_event)S(ibv_gid_entry)
O(ibv_context,ops)O(ibv_context,async_fd)O(ibv_context,abi_compat)O(ibv_context_ops,poll_cq)O(ibv_context_ops,req_notify_cq)O(ibv_context_ops,post_srq_recv)O(ibv_context_ops,post_send)O(ibv_context_ops,post_recv)
O(ibv_qp,qp_num)O(ibv_qp,events_completed)O(ibv_send_wr,imm_data)O(ibv_send_wr,wr.rdma.remote_addr)O(ibv_send_wr,wr.rdma.rkey)O(ibv_send_wr,qp_type)
O(ibv_wc,imm_data)O(ibv_wc,wc_flags)O(ibv_qp_attr,ah_attr)O(ibv_qp_attr,max_rd_atomic)O(ibv_qp_attr,rate_limit)O(ibv_ah_attr,sl)O(ibv_global_route,traffic_class)O(ibv_port_attr,link_layer)O(ibv_device_attr,max_qp_rd_atom)O(ibv_device_attr,phys_port_cnt)O(ibv_cq,cqe)O(ibv_cq,async_events_completed)O(ibv_srq,events_completed)O(ibv_gid_entry,gid_type)}
