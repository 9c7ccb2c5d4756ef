#pragma once
typedef int cusolverStatus_t;
#define CUSOLVER_STATUS_SUCCESS 0
