#pragma once
typedef struct cusolverDnContext* cusolverDnHandle_t;
